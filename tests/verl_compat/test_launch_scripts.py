"""``trellis config from-verl run.sh``: verl launch scripts (the shapes of verl's own, named in each
file's header) read without running them, the entry point choosing the mode, and the features they
switch on converted with verl's semantics: LoRA, DAPO's group filter and overlong buffer,
one-step-off and fully-async training, distillation and a hydra config with its defaults."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from cli_runs import run_cli as trellis

from trellis_demo.tasks import write_rows
from trellis_verl_compat.convert import convert, read_verl
from trellis_verl_compat.launch import read_script

SCRIPTS = Path(__file__).parent / "launch"


def converted(script: str, *extra: str, cwd: Path = SCRIPTS) -> tuple[dict, str]:
    out = trellis("config", "from-verl", str(SCRIPTS / script), *extra, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout), out.stderr


def test_shell_expansion_as_bash_does_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    monkeypatch.delenv("MODEL", raising=False)
    script = tmp_path / "run.sh"
    script.write_text(
        "set -x\n"
        'MODEL=${MODEL:-"${HOME}/models/q"}  # a default holding a variable\n'
        "bsz=4\nmini=$(((bsz * 3) / 2))\n"
        "args=(\n  data.train_batch_size=${bsz}\n  'trainer.experiment_name=a b'  # quoted\n)\n"
        'HERE=$(cd "$(dirname "$0")" && pwd)\n'
        "VLLM_USE_V1=1 python3 -m verl.trainer.main_ppo \\\n"
        '    "${args[@]}" actor_rollout_ref.model.path=$MODEL \\\n'
        "    actor_rollout_ref.actor.ppo_mini_batch_size=$mini data.train_files=$HERE/t.parquet \\\n"
        "    trainer.project_name='$HOME' $@\n"
    )
    launch = read_script(script)
    assert launch.entry == "verl.trainer.main_ppo"
    assert launch.overrides == [
        "data.train_batch_size=4",
        "trainer.experiment_name=a b",
        "actor_rollout_ref.model.path=/home/u/models/q",
        "actor_rollout_ref.actor.ppo_mini_batch_size=6",
        f"data.train_files={tmp_path.resolve()}/t.parquet",
        "trainer.project_name=$HOME",  # single quotes: not expanded
    ]


def test_lora_script_trains_an_adapter_at_its_rank_and_alpha():
    cfg, err = converted("lora.sh")
    assert cfg["actor"]["adapter"] == {"rank": 64, "alpha": 32}  # target_modules: verl's all-linear is trellis's default
    assert cfg["actor"]["optim"]["lr"] == 3e-6 and "lora" not in err


def test_geo3k_script_keeps_its_image_column_frozen_vision_tower_and_padding_free_forwards():
    cfg, err = converted("geo3k.sh")
    assert cfg["data"]["image_key"] == "images"
    assert cfg["backend"] == {"activation_checkpointing": True, "padding_free": True, "freeze_vision_tower": True, "offload_params": False,
                              "offload_optimizer": False}  # fmt: skip
    assert "vision" not in err and "image_key" not in err


def test_dapo_script_filters_groups_penalises_overlong_and_warms_up_from_zero():
    cfg, err = converted("dapo.sh")
    assert cfg["algorithm"]["dynamic_sampling"] == {"enable": True, "metric": "acc", "max_rounds": 10}
    assert cfg["reward"]["overlong"] == {"buffer_len": 4096, "penalty": 1.0}
    assert "kwargs" not in cfg["reward"]  # the manager's options never reach compute_score
    assert cfg["sampling"]["max_new_tokens"] == 20480 and cfg["data"]["max_prompt_length"] == 2048
    assert cfg["actor"]["policy_loss"] == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 10.0}
    assert cfg["actor"]["optim"]["warmup_steps"] == 10 and cfg["actor"]["optim"]["warmup_from_zero"] is True
    assert cfg["trainer"]["keep_checkpoints"] is None  # verl keeps every checkpoint
    assert (cfg["validation"]["temperature"], cfg["trainer"]["total_steps"]) == (1.0, 200)
    assert "data.gen_batch_size=1536: trellis generates data.train_batch_prompts new prompts per dynamic-sampling round" in err
    assert "overlong" not in err and "filter_groups" not in err and "no trellis counterpart" not in err


def test_manager_kwargs_convert_only_under_the_dapo_manager():
    base = ["actor_rollout_ref.model.path=/m", "trainer.total_training_steps=2", "data.max_response_length=64"]
    buffer = ["+reward.reward_kwargs.overlong_buffer_cfg.enable=True", "+reward.reward_kwargs.overlong_buffer_cfg.len=16"]
    naive = convert(read_verl([*base, *buffer]))
    assert "overlong" not in naive.config["reward"]
    why = {k: reason for k, _, reason in naive.unmapped}
    assert why["reward.reward_kwargs"].startswith("verl's 'naive' reward manager ignores the overlong buffer")
    dapo = convert(read_verl([*base, *buffer, "reward.reward_manager.name=dapo", "+reward.reward_kwargs.max_resp_len=48"]))
    assert dapo.config["reward"]["overlong"] == {"buffer_len": 16, "penalty": 1.0}
    assert "max_resp_len=48" in dapo.differences["reward.reward_kwargs"][1]  # measured from another length than the sampling cap
    batch = convert(read_verl([*base, "reward.reward_manager.name=batch", "+reward.reward_kwargs.method=strict"]))
    assert batch.config["reward"]["batched"] is True and "kwargs" not in batch.config["reward"]
    assert "a keyword argument for compute_score is custom_reward_function.reward_kwargs" in batch.unmapped[0][2]


def test_fully_async_script_runs_ahead_with_verls_sync_batch_and_step_count():
    cfg, err = converted("fully_async.sh")
    mini, require, trigger = 32, 4, 4
    assert cfg["data"]["train_batch_prompts"] == mini * require * trigger  # prompts between weight syncs
    assert cfg["actor"]["mini_batch_samples"] == mini * 16  # one optimizer step per verl mini-batch
    assert cfg["trainer"]["total_steps"] == 512 * 400 // (mini * require * trigger)  # total_rollout_steps, not 30 epochs
    assert (cfg["trainer"]["async_mode"], cfg["trainer"]["max_staleness"], cfg["trainer"]["partial_rollout"]) == ("fully_async", 1, True)
    assert "trainer.max_staleness = ceil(0.1) = 1" in err
    assert cfg["reward"]["overlong"] == {"buffer_len": 4096, "penalty": 1.0}


@pytest.mark.parametrize("threshold", [0, 0.5, 2])
def test_staleness_threshold_bounds_whole_steps(threshold):
    given = ["actor_rollout_ref.model.path=/m", f"async_training.staleness_threshold={threshold}"]
    trainer = convert(read_verl(given), entry="verl.experimental.fully_async_policy.fully_async_main").config["trainer"]
    assert trainer["max_staleness"] == math.ceil(threshold)
    assert trainer.get("partial_rollout") is (True if threshold else None)  # verl: partial rollouts act above 0 only


def test_one_step_off_script_generates_one_step_ahead():
    cfg, err = converted("one_step_off.sh")
    assert cfg["trainer"]["async_mode"] == "one_step"
    assert (cfg["data"]["train_batch_prompts"], cfg["actor"]["mini_batch_samples"], cfg["trainer"]["procs_per_node"]) == (32, 32, 6)
    assert "rollout.n_gpus_per_node=2: the rollout GPUs of verl's one-step-off" in err


def test_distillation_script_distils_from_its_teacher():
    cfg, err = converted("distill.sh")
    assert cfg["teacher"]["path"] == "Qwen/Qwen3-8B"
    distill = cfg["actor"]["distill"]
    assert distill == {"coef": 1.0, "use_policy_loss": False, "top_k": 64, "loss": {"name": "forward_kl"}}
    assert "trellis adds one bucket for the mass outside the teacher's top-64" in err


def test_distillation_with_policy_gradient_is_the_reverse_kl_advantage():
    base = ["actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=grpo", "distillation.enabled=True"]
    teacher = "distillation.teacher_models.teacher_model.model_path=/t"
    conversion = convert(
        read_verl(
            [
                *base,
                teacher,
                "distillation.distillation_loss.loss_mode=k1",
                "distillation.distillation_loss.use_policy_gradient=True",
                "distillation.distillation_loss.use_task_rewards=False",
            ]
        )
    )
    assert conversion.config["algorithm"]["advantage"] == {"name": "reverse_kl_teacher", "reward_weight": 0.0}
    assert "distill" not in conversion.config["actor"] and conversion.differences == {}
    missing = convert(read_verl(base))
    assert "distillation.teacher_models.teacher_model.model_path" in {k: r for k, _, r in missing.unmapped}["distillation.enabled"]


def test_hydra_config_name_follows_its_defaults_and_the_engine_need_not_be_installed():
    """The script names its config by --config-path/--config-name; the YAML's own keys (multi-turn
    on, 5 assistant turns) convert under the script's overrides, and sglang, not installed in this
    session, does not stop the conversion."""
    cfg, err = converted("multiturn/run.sh", cwd=SCRIPTS / "multiturn")
    assert cfg["multi_turn"]["enable"] is True and cfg["multi_turn"]["max_assistant_turns"] == 5
    assert cfg["multi_turn"]["tools"][0]["verl_class"] == "verl.tools.gsm8k_tool.Gsm8kTool"
    assert cfg["rollout"] == {"name": "sglang"} and cfg["sampling"]["n"] == 16
    assert cfg["multi_turn"]["max_tool_response_chars"] == 256  # verl's default cap
    assert "rollout 'sglang' is not installed" in err


def test_the_trainer_line_is_found_after_data_preparation_and_by_its_file(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k\n"
        "python3 /src/verl/verl/experimental/one_step_off_policy/main_ppo.py trainer.total_training_steps=3\n"
    )
    launch = read_script(script)
    assert (launch.entry, launch.overrides) == ("verl.experimental.one_step_off_policy.main_ppo", ["trainer.total_training_steps=3"])
    script.write_text("python3 prepare.py\necho done\n")
    with pytest.raises(Exception, match=r"has no 'python3 -m <verl entry point> ...' line \(its python commands run prepare.py\)"):
        read_script(script)


def test_entry_points_of_other_trainers_are_refused_naming_what_to_use(tmp_path):
    script = tmp_path / "gen.sh"
    script.write_text("python3 -m verl.trainer.main_generation data.path=x\n")
    with pytest.raises(Exception, match="is generation only; trellis has no generation entry point"):
        convert({"data.path": "x"}, entry="verl.trainer.main_generation")
    out = trellis("config", "from-verl", str(script), cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "verl entry point verl.trainer.main_generation is generation only" in out.stderr


def test_sft_script_converts_to_the_sft_recipe_with_its_adapter_schedule_and_world(tmp_path):
    """verl's SFT trainer (torchrun, hydra group choices ``engine=fsdp optim=fsdp``) is trellis's sft
    recipe: batch, micro-batch and token budget, LoRA, the cosine schedule with its floor, the ranks
    torchrun starts, and the epochs and after_each_epoch validation counted from the training rows."""
    rows = [{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}] * 1000
    data = write_rows(rows, tmp_path / "train.parquet")
    cfg, err = converted("sft.sh", f"data.train_files={data}")
    assert cfg["recipe"] == "sft" and cfg["data"]["batch_samples"] == 256 and cfg["data"]["max_length"] == 2048
    assert cfg["train"]["micro_batch_samples"] == 4 and cfg["train"]["max_tokens_per_micro_batch"] == 8192
    assert cfg["train"]["adapter"] == {"rank": 32, "alpha": 16, "target_modules": ["all-linear"]}
    optim = cfg["train"]["optim"]
    assert (optim["lr"], optim["lr_schedule"], optim["min_lr_ratio"], optim["betas"]) == (1e-5, "cosine", 0.1, [0.9, 0.95])
    steps_per_epoch = 1000 // 256
    assert cfg["trainer"]["total_steps"] == 2 * steps_per_epoch and cfg["trainer"]["val_every_steps"] == steps_per_epoch
    assert optim["warmup_steps"] == int(0.05 * 2 * steps_per_epoch)
    assert cfg["trainer"]["procs_per_node"] == 8 and cfg["trainer"]["controller"] == "ray"  # torchrun --nproc_per_node=8
    assert cfg["backend"] == {"activation_checkpointing": True, "padding_free": True}
    assert "data.truncation='error': trellis cuts a sample longer than data.max_length on the right" in err
    assert "engine.ulysses_sequence_parallel_size=2: no sequence parallelism" in err
    _, err = converted("sft.sh", "data.messages_key=conversations", "trainer.total_training_steps=3")
    assert "data.messages_key='conversations': trellis reads a row's chat from its 'messages' column" in err


def test_an_older_sft_script_converts_with_that_trainers_defaults(tmp_path):
    """verl's fsdp_sft_trainer (before verl 0.9): its own defaults (lr 1e-5, cosine, warm-up ratio
    0.1 from lr 0, betas 0.9/0.95) and keys; the GSM8K target in extra_info.answer is trellis's default."""
    script = tmp_path / "run_gemma_2b.sh"
    script.write_text(
        "torchrun --standalone --nnodes=1 --nproc_per_node=8 -m verl.trainer.fsdp_sft_trainer \\\n"
        "    data.train_files=$HOME/data/gsm8k/train.parquet data.prompt_key=extra_info data.response_key=extra_info \\\n"
        "    +data.prompt_dict_keys=['question'] +data.response_dict_keys=['answer'] data.micro_batch_size_per_gpu=4 \\\n"
        "    model.partial_pretrain=google/gemma-2b-it trainer.total_training_steps=20 $@\n"
    )
    out = trellis("config", "from-verl", str(script), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout.split("\n", 1)[1])
    assert cfg["model"]["path"] == "google/gemma-2b-it" and "response_key" not in cfg["data"]
    optim = cfg["train"]["optim"]
    assert (optim["lr"], optim["lr_schedule"], optim["warmup_steps"], optim["warmup_from_zero"]) == (1e-5, "cosine", 2, True)
    assert optim["betas"] == [0.9, 0.95] and cfg["backend"]["padding_free"] is False and cfg["trainer"]["procs_per_node"] == 8
    assert "data.prompt_key='extra_info': trellis reads a prompt-and-response row's prompt from its 'prompt' column" in out.stderr


def test_ppo_script_gives_the_critic_the_actors_batching():
    cfg, err = converted("ppo_gae.sh")
    assert cfg["algorithm"]["advantage"] == {"name": "gae"} and cfg["critic"]["model_path"] == "deepseek-ai/deepseek-llm-7b-chat"
    assert (cfg["critic"]["mini_batch_samples"], cfg["critic"]["micro_batch_samples"]) == (256, 32)  # the actor's mini-batch, its own micro
    assert cfg["critic"]["optim"]["lr"] == 1e-5 and "critic_warmup" not in err
    assert "critic.model.enable_gradient_checkpointing=True: the backend section's activation_checkpointing holds for every role" in err


def test_rollout_correction_script_keeps_its_importance_weights_and_bypass_loss():
    cfg, err = converted("rollout_corr.sh")
    loss = cfg["actor"]["policy_loss"]
    assert loss == {
        "name": "bypass_mode",
        "loss_type": "reinforce",
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_is_batch_normalize": True,
    }
    assert cfg["algorithm"]["advantage"] == {"name": "rloo"}
    assert "algorithm.gamma=1.0: advantage 'rloo' has no option gamma" in err


def test_gspo_script_with_environment_setup_and_data_preparation_converts():
    """eval, exports, a data-preparation python command inside an if, $(basename ...) and nested
    $(((...))) are read as bash would; GSPO's clip range and the dapo manager's overlong buffer
    (off, so no penalty) convert."""
    cfg, err = converted("gspo.sh")
    assert cfg["actor"]["policy_loss"] == {"name": "gspo", "clip_ratio_low": 0.0003, "clip_ratio_high": 0.0004}
    assert (cfg["actor"]["loss_agg_mode"], cfg["actor"]["max_tokens_per_micro_batch"]) == ("seq-mean-token-mean", (2048 + 8192) * 2)
    assert cfg["data"]["train_path"] == ["/data/gsm8k/train.parquet"] and "overlong" not in cfg["reward"]
    assert cfg["actor"]["optim"]["warmup_steps"] == int(0.05 * 500) and cfg["actor"]["optim"]["grad_clip"] == 1.0
    assert "trainer.experiment_name='gspo-Qwen2.5-3B-Instruct-RL'" in err  # $(basename $MODEL_PATH)


def test_genrm_remote_script_scores_whole_batches_with_its_function():
    """verl's batch reward manager calls compute_score_batch(data_sources, solution_strs,
    ground_truths, extra_infos): trellis's batched reward, the same call."""
    cfg, err = converted("genrm_remote.sh")
    assert cfg["reward"] == {"name": "compute_score_batch", "path": "recipe/genrm_remote/reward_function.py", "batched": True}
    assert "reward_manager" not in err and cfg["actor"]["kl_loss_type"] == "low_var_kl"


def test_fapo_script_serves_its_reward_model_to_its_function_as_verls_reward_router():
    """A reward model enabled beside a custom function is verl's GenRM pattern: the model is served
    (on the script's engine, not installed here) and the function gets the router; it is not the
    reward model's role. Its Ray job line, hydra config and DAPO manager convert as elsewhere."""
    cfg, err = converted("fapo/run.sh", cwd=SCRIPTS / "fapo")
    assert cfg["reward"]["judge"] == {"model": f"{Path.home()}/verl/models/FAPO-GenRM-4B", "engine": "sglang", "max_new_tokens": 512}
    assert (cfg["reward"]["name"], cfg["reward"]["path"]) == ("compute_score_fapo", "recipe/fapo/reward_fn.py") and "model" not in cfg["reward"]
    assert cfg["reward"]["overlong"] == {"buffer_len": 4096, "penalty": 1.0}
    assert "reward.judge.engine: rollout 'sglang' is not installed" in err and "reward_model.rollout.gpu_memory_utilization=0.95" in err
    alone, _ = converted("fapo/run.sh", "custom_reward_function.path=null", cwd=SCRIPTS / "fapo")
    assert alone["reward"]["model"]["path"].endswith("FAPO-GenRM-4B") and "judge" not in alone["reward"]  # scored by the model's role


def test_reinforce_and_sapo_scripts_keep_their_estimator_and_loss():
    cfg, _ = converted("reinforce_pp.sh")
    assert cfg["algorithm"]["advantage"] == {"name": "reinforce_plus_plus_baseline"}
    assert (cfg["algorithm"]["use_kl_in_reward"], cfg["algorithm"]["kl_penalty"], cfg["algorithm"]["kl_coef"]) == (True, "kl", 0.001)
    home = str(Path.home())
    assert cfg["data"]["train_path"] == [f"{home}/data/gsm8k/train.parquet", f"{home}/data/math/train.parquet"]
    cfg, _ = converted("sapo.sh")
    assert cfg["actor"]["policy_loss"] == {"name": "sapo", "tau_pos": 1.0, "tau_neg": 1.05}


def test_moe_script_replays_the_engines_routes_on_fsdp():
    """verl's Megatron mixture-of-experts script with R3: trellis replays the engine's experts, on the
    fsdp backend (its megatron backend builds dense models), and says why each Megatron size stays."""
    cfg, err = converted("moe_r3.sh")
    assert cfg["actor"]["router_replay"] == "rollout" and "backend" not in cfg
    assert "actor_rollout_ref.actor.strategy='megatron': a mixture-of-experts script (expert_model_parallel_size=8, router_replay.mode=R3)" in err
    assert "actor_rollout_ref.actor.megatron.expert_model_parallel_size=8: trellis trains a mixture-of-experts model on fsdp" in err
    assert "tensor_model_parallel_size=2: the script trains a mixture-of-experts model" in err


def test_a_dense_megatron_script_runs_on_the_megatron_backend_at_its_sizes():
    """verl's dense Megatron GRPO script (the hydra config ppo_megatron_trainer chooses the strategy),
    and the MoE script without its experts; the reference's sizes are the backend's too."""
    cfg, err = converted("megatron.sh")
    assert cfg["backend"] == {"name": "megatron", "tensor_parallel": 2, "pipeline_parallel": 2}
    assert cfg["data"]["train_path"] == [f"{Path.home()}/data/gsm8k/train.parquet", f"{Path.home()}/data/math/train.parquet"]
    assert "ref.megatron.tensor_model_parallel_size=2: every role runs at the backend section's sizes" in err
    megatron = "actor_rollout_ref.actor.megatron."
    dense = [
        megatron + "expert_model_parallel_size=1",
        megatron + "router_replay.mode=disabled",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=False",
    ]
    cfg, err = converted("moe_r3.sh", *dense)
    assert cfg["backend"] == {"name": "megatron", "tensor_parallel": 2, "pipeline_parallel": 1}
    assert "router_replay" not in cfg["actor"] and "megatron." not in err and "strategy" not in err
    fsdp, err = converted("lora.sh", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
    assert "backend" not in fsdp or "tensor_parallel" not in fsdp["backend"]
    assert "tensor_model_parallel_size=2: a Megatron setting, and the script's actor strategy is not megatron" in err
