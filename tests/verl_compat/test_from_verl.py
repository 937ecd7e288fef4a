"""``trellis config from-verl``: a verl PPO/GRPO config (YAML and/or overrides) becomes a trellis
rl config that composes with the same settings; the verl keys it could not map are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_runs import run_cli as trellis

from trellis.config import compose
from trellis.plugins import load_plugins
from trellis_verl_compat.convert import RULES, check_converted, convert, read_verl
from trellis_verl_compat.rule import MODE
from trellis_verl_compat.sft import SFT_RULES

GRPO_COMMAND = [
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.rollout.n=5",
    "data.train_batch_size=256",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.temperature=0.8",
    "trainer.total_epochs=15",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.test_freq=5",
    "trainer.save_freq=-1",
    "trainer.logger=['console','wandb']",
    "actor_rollout_ref.model.use_remove_padding=True",
    "trainer.project_name=verl_grpo_example_gsm8k",
]


@pytest.fixture
def train_file(tmp_path) -> Path:
    row = {"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "2"}}
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(1000)))
    return path


def composed(conversion, tmp_path):
    path = tmp_path / "converted.yaml"
    from omegaconf import OmegaConf

    path.write_text(OmegaConf.to_yaml(OmegaConf.create(conversion.config)))
    return compose(path, [], load_plugins().registry)


def test_grpo_command_line_composes_with_verls_settings(train_file, tmp_path):
    registry = load_plugins().registry
    verl = [*GRPO_COMMAND, f"data.train_files={train_file}", f"data.val_files=[{train_file},{train_file}]"]
    cfg = composed(convert(read_verl(verl), registry), tmp_path)
    assert cfg.model.path == "Qwen/Qwen2.5-3B-Instruct"
    assert cfg.data.train_path == str(train_file) and list(cfg.data.val_path) == [str(train_file)] * 2
    assert (cfg.data.train_batch_prompts, cfg.data.max_prompt_length, cfg.sampling.max_new_tokens) == (256, 512, 1024)
    assert (cfg.sampling.n, cfg.sampling.temperature) == (5, 0.8)
    assert cfg.actor.mini_batch_samples == 64 * 5  # verl's mini-batch counts prompts; trellis's counts samples
    assert cfg.actor.micro_batch_samples == 16
    assert (cfg.actor.optim.lr, cfg.actor.optim.weight_decay) == (1e-6, 0.01)  # weight decay: verl's default
    assert (cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type, cfg.actor.entropy_coeff) == (True, 0.001, "low_var_kl", 0.0)
    assert cfg.algorithm.advantage.name == "grpo" and cfg.rollout.name == "hf" and cfg.reward.name == "verl_default"  # verl's scoring
    assert cfg.trainer.total_steps == 15 * (1000 // 256)  # epochs x full batches per epoch
    assert (cfg.trainer.nnodes, cfg.trainer.procs_per_node, cfg.trainer.controller) == (1, 8, "ray")
    assert (cfg.trainer.val_every_steps, cfg.trainer.save_every_steps) == (5, 0)
    assert list(cfg.trainer.trackers) == ["console", "wandb", "jsonl"]


def test_a_multi_gpu_launch_converts_where_trellis_ray_is_not_installed(train_file):
    """verl's 8 GPUs become trainer.controller=ray; without trellis-ray here the conversion still
    completes and says where the controller is checked (the machine that trains has it)."""
    registry = load_plugins().registry
    registry.remove_plugin("ray")
    conversion = convert(read_verl([*GRPO_COMMAND, f"data.train_files={train_file}"]), registry)
    check_converted(conversion, registry)
    assert conversion.config["trainer"]["controller"] == "ray"
    notes = [n for n in conversion.notes if n.startswith("trainer.controller:")]
    assert len(notes) == 1 and "controller 'ray' is not installed" in notes[0] and "checked there" in notes[0], conversion.notes


def test_verl_yaml_with_overrides_on_top(tmp_path):
    verl_yaml = tmp_path / "ppo.yaml"
    verl_yaml.write_text(
        """
actor_rollout_ref:
  model: {path: /models/base}
  actor:
    clip_ratio_low: 0.2
    clip_ratio_high: 0.28
    clip_ratio_c: 10.0
    loss_agg_mode: seq-mean-token-sum
    ppo_epochs: 2
    grad_clip: 0.5
    optim: {lr: 3e-6, lr_warmup_steps: 10, warmup_style: cosine, min_lr_ratio: 0.1}
  rollout: {name: hf, n: 1, top_p: 0.9, top_k: 50, val_kwargs: {n: 4, temperature: 0.6}}
critic:
  model: {path: /models/critic}
  optim: {lr: 1e-5}
  ppo_mini_batch_size: ${actor_rollout_ref.actor.ppo_mini_batch_size}
  cliprange_value: 0.2
algorithm:
  adv_estimator: gae
  gamma: 0.99
  lam: 0.95
  use_kl_in_reward: true
  kl_penalty: kl
  kl_ctrl: {type: adaptive, kl_coef: 0.002, target_kl: 0.05, horizon: 500}
data: {train_files: /data/train.parquet, train_batch_size: 32}
trainer: {total_training_steps: 100, total_epochs: 3, nnodes: 1, n_gpus_per_node: 1, resume_mode: disable, val_before_train: false}
"""
    )
    overrides = ["actor_rollout_ref.actor.ppo_mini_batch_size=8", "+critic.ppo_epochs=3"]
    conversion = convert(read_verl([str(verl_yaml), *overrides]), load_plugins().registry)
    cfg = composed(conversion, tmp_path)
    loss = cfg.actor.policy_loss
    assert (loss.name, loss.clip_ratio_low, loss.clip_ratio_high, loss.clip_ratio_c) == ("vanilla", 0.2, 0.28, 10.0)
    assert (cfg.actor.loss_agg_mode, cfg.actor.ppo_epochs, cfg.actor.mini_batch_samples) == ("seq-mean-token-sum", 2, 8)
    assert (cfg.actor.optim.lr, cfg.actor.optim.grad_clip, cfg.actor.optim.warmup_steps, cfg.actor.optim.lr_schedule) == (3e-6, 0.5, 10, "cosine")
    assert cfg.actor.optim.min_lr_ratio == 0.1
    assert (cfg.sampling.top_p, cfg.sampling.top_k, cfg.validation.n, cfg.validation.temperature) == (0.9, 50, 4, 0.6)
    assert (cfg.critic.model_path, cfg.critic.optim.lr, cfg.critic.mini_batch_samples, cfg.critic.cliprange_value) == ("/models/critic", 1e-5, 8, 0.2)
    assert cfg.critic.ppo_epochs == 3
    adv = cfg.algorithm.advantage
    assert (adv.name, adv.gamma, adv.lam) == ("gae", 0.99, 0.95)
    algo = cfg.algorithm
    assert (algo.use_kl_in_reward, algo.kl_penalty, algo.kl_ctrl_type, algo.kl_coef, algo.target_kl, algo.kl_horizon) == (
        True,
        "kl",
        "adaptive",
        0.002,
        0.05,
        500,
    )
    assert (cfg.trainer.total_steps, cfg.trainer.controller, cfg.trainer.resume, cfg.validation.before_train) == (100, "local", "never", False)
    assert conversion.unmapped == []


def test_unmapped_keys_are_named_with_why():
    conversion = convert(
        read_verl(
            [
                "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                "actor_rollout_ref.actor.clip_ratio_c=3.0",
                "actor_rollout_ref.ref.fsdp_config.param_offload=True",
                "trainer.logger=[console,swanlab]",
                "trainer.critic_warmup=2",
                "data.train_files=/nowhere/train.parquet",
                "data.prompt_key=question",
                "data.reward_fn_key=data_source",
                "actor_rollout_ref.rollout.name=hf",
                "something.verl.added=1",
            ]
        ),
        load_plugins().registry,
    )
    why = {key: reason for key, _, reason in conversion.unmapped}
    assert why["actor_rollout_ref.actor.clip_ratio_c"] == "policy_loss 'gspo' has no option clip_ratio_c"
    assert "backend section" in why["actor_rollout_ref.ref.fsdp_config.param_offload"]  # the actor's is backend.offload_params
    assert "swanlab is not one" in why["trainer.logger"]
    assert "trainer.critic_warmup" in why and "something.verl.added" in why
    assert why["data.prompt_key"] == "the prompt column is always 'prompt'"
    assert "data.reward_fn_key" not in why  # data_source: what trellis does anyway
    # verl's default of 30 epochs needs the training rows, which are not there
    assert "/nowhere/train.parquet" in why["trainer.total_epochs"] and why["trainer.total_epochs"].endswith("(verl's default)")
    assert conversion.config["actor"]["policy_loss"] == {"name": "gspo"}
    assert "trainer" not in conversion.config or "total_steps" not in conversion.config["trainer"]
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=256" in conversion.defaults_used


def test_cli_prints_the_config_and_reports_on_stderr(train_file, tmp_path):
    out = trellis("config", "from-verl", *GRPO_COMMAND, f"data.train_files={train_file}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (tmp_path / "run.yaml").write_text(out.stdout)
    shown = trellis("config", "show", "run.yaml", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "mini_batch_samples: 320" in shown.stdout and "total_steps: 45" in shown.stdout
    assert "padding_free: true" in shown.stdout  # actor_rollout_ref.model.use_remove_padding=True
    assert "trainer.project_name='verl_grpo_example_gsm8k'" in out.stderr

    missing = trellis("config", "from-verl", "nowhere.yaml", cwd=tmp_path)
    assert missing.returncode == 2 and "verl config 'nowhere.yaml' does not exist" in missing.stderr


def test_every_rule_is_in_the_docs_table():
    doc = (Path(__file__).parents[2] / "docs" / "coming-from-verl.md").read_text()
    assert [rule.verl for rule in RULES if f"`{rule.verl}`" not in doc and rule.verl != MODE] == []  # MODE: the entry point's
    sft = doc[doc.index("## SFT scripts") : doc.index("## Converting a config")]
    assert [rule.verl for rule in SFT_RULES if f"`{rule.verl}`" not in sft and not rule.verl.startswith(("optim.", "grad_clip"))] == []


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ("- actor_rollout_ref\n- data\n", "verl config 'in.yaml' holds a YAML list, not verl's mapping of sections (actor_rollout_ref, "),
        ("name: my-app\nport: 80\n", "verl config 'in.yaml' has none of verl's sections (actor_rollout_ref, algorithm, critic, "),
        (
            "recipe: rl\nmodel: {path: /m}\n",
            "'in.yaml' is a trellis config (it has 'recipe: rl'), not a verl one; use it as it is: trellis train in.yaml",
        ),
        ("data: {train_batch_size: [1\n", "verl config 'in.yaml' is not valid YAML: while parsing a flow sequence"),
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "verl config 'in.yaml' is not a text file; give a verl YAML file"),
        (
            "data: {train_batch_size: many}\ntrainer: {total_training_steps: 3}\n",
            "the verl config does not convert (from verl key 'data.train_batch_size'): config key 'data.train_batch_prompts' has value 'many'",
        ),
    ],
    ids=["yaml-list", "unrelated-yaml", "trellis-config", "bad-yaml", "binary", "non-numeric-batch-size"],
)
def test_what_is_not_a_verl_config_is_refused_with_the_reason(tmp_path, content, error):
    path = tmp_path / "in.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = trellis("config", "from-verl", "in.yaml", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines()[-1].startswith(f"trellis: error: {error}"), out.stderr


def test_a_hydra_file_whose_interpolations_name_unmerged_files_converts_what_it_gives(tmp_path):
    (tmp_path / "ppo.yaml").write_text(
        "defaults:\n  - actor@actor_rollout_ref.actor: ${model_engine}_actor\n  - _self_\n"
        "actor_rollout_ref:\n  model: {path: /models/base}\n  actor: {ppo_epochs: '${model_engine}', optim: {lr: 2.0e-6}}\n"
        "trainer: {total_training_steps: 7}\n"
    )
    out = trellis("config", "from-verl", "ppo.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    converted = yaml.safe_load(out.stdout)
    assert converted["model"]["path"] == "/models/base" and converted["actor"]["optim"]["lr"] == 2e-6
    assert converted["trainer"]["total_steps"] == 7
    assert "defaults=[{'actor@actor_rollout_ref.actor': '${model_engine}_actor'}, '_self_']: a YAML file given is read flat" in out.stderr
    assert "actor_rollout_ref.actor.ppo_epochs='${model_engine}': its interpolation names a key that no given file or override sets" in out.stderr


def test_multi_turn_converts_interactions_tools_limits_and_scoring_as_verl_runs_them(tmp_path):
    (tmp_path / "interactions.yaml").write_text(
        "interaction:\n  - name: checker\n    class_name: my_pkg.checks.AnswerInteraction\n    config: {strict: true}\n"
    )
    schema = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}
    (tmp_path / "tools.yaml").write_text(
        yaml.safe_dump({"tools": [{"class_name": "my_pkg.tools.Calc", "config": {"type": "native"}, "tool_schema": schema}]})
    )
    verl = [
        "actor_rollout_ref.model.path=/models/base",
        "trainer.total_training_steps=5",
        "data.max_response_length=300",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path=interactions.yaml",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=tools.yaml",
        "actor_rollout_ref.rollout.multi_turn.max_user_turns=3",  # max_assistant_turns left null: no limit in verl
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=500",
    ]
    out = trellis("config", "from-verl", *verl, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    mt = yaml.safe_load(out.stdout)["multi_turn"]
    assert mt["interactions"] == [{"name": "checker", "verl_class": "my_pkg.checks.AnswerInteraction", "options": {"strict": True}}]
    assert mt["tools"] == [{"verl_class": "my_pkg.tools.Calc", "options": {"type": "native"}, "schema": schema}]
    assert (mt["max_assistant_turns"], mt["max_user_turns"], mt["max_response_tokens"]) == (300, 3, 300)
    assert (mt["score"], mt["tool_parser"], mt["max_tool_response_chars"]) == ("reward", "hermes", 500)
    assert "multi_turn" not in out.stderr  # every multi-turn key converted


def test_rewards_optimizer_and_backend_keys_convert(tmp_path):
    (tmp_path / "ppo.yaml").write_text(
        """
actor_rollout_ref:
  model: {path: /models/base, enable_gradient_checkpointing: true, use_remove_padding: true}
  actor:
    grad_clip: 1.0
    optim: {lr: 1.0e-6, clip_grad: 0.3}
    fsdp_config: {model_dtype: bf16, param_offload: true, optimizer_offload: true}
reward:
  custom_reward_function: {path: my_reward.py, name: score_it, reward_kwargs: {alpha: 0.5, mode: strict}}
trainer: {total_training_steps: 3}
"""
    )
    out = trellis("config", "from-verl", "ppo.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    converted = yaml.safe_load(out.stdout)
    assert converted["reward"] == {"name": "score_it", "path": "my_reward.py", "kwargs": {"alpha": 0.5, "mode": "strict"}}
    assert converted["actor"]["optim"]["grad_clip"] == 0.3  # optim.clip_grad, what verl clips with, wins over grad_clip
    assert converted["backend"] == {
        "activation_checkpointing": True,
        "padding_free": True,
        "dtype": "bfloat16",
        "offload_params": True,
        "offload_optimizer": True,
    }
    assert "verl keys not converted" not in out.stderr, out.stderr


def test_a_reward_model_converts_to_the_reward_model_role():
    def converted(*args: str):
        conversion = convert(read_verl(list(args)), load_plugins().registry)
        return conversion.config["reward"], {key: reason for key, _, reason in conversion.unmapped}

    reward, why = converted(
        "reward_model.enable=True",
        "reward_model.model.path=/models/rm",
        "reward_model.model.input_tokenizer=/models/other",
        "reward_model.micro_batch_size_per_gpu=4",
    )
    assert reward == {"model": {"path": "/models/rm", "layout": "conversation"}}  # alone the reward, read as verl's reward loop renders it
    assert "re-tokenises" in why["reward_model.model.input_tokenizer"] and "micro-batching" in why["reward_model.micro_batch_size_per_gpu"]
    assert "reward_model.enable" not in why and "reward_model.model.path" not in why
    reward, why = converted("reward_model.enable=False", "reward_model.model.path=/models/rm")
    assert reward == {"name": "verl_default"} and not [k for k in why if k.startswith("reward_model")]  # off: verl ignores the path too
    _, why = converted("reward_model.enable=True")
    assert "reward_model.model.path is not given" in why["reward_model.enable"]
    reward, _ = converted("reward.reward_model.enable=True", "reward.reward_model.model_path=/models/rm")  # verl 0.9.1's keys
    assert reward == {"model": {"path": "/models/rm", "layout": "conversation"}}


def test_verl_agent_loop_config_file_becomes_agent_loop_entries(tmp_path):
    """Each ``{name, _target_, ...}`` of verl's ``agent_loop_config_path`` file is a
    ``multi_turn.agent_loops`` entry run by the ``verl`` loop (``_target_`` its class, the other
    keys its constructor's kwargs); a file that is not there, or a run that is not multi-turn, is
    named in the report instead."""
    (tmp_path / "loops.yaml").write_text(
        "- name: check_again_agent\n  _target_: my_pkg.loops.CheckAgainAgentLoop\n"
        "- name: search_agent\n  _target_: my_pkg.loops.SearchAgentLoop\n  max_searches: 3\n  engine: {url: http://127.0.0.1:8000}\n"
    )
    base = ["actor_rollout_ref.model.path=/models/base", "trainer.total_training_steps=5"]
    multi_turn = "actor_rollout_ref.rollout.multi_turn.enable=true"
    out = trellis("config", "from-verl", *base, multi_turn, "actor_rollout_ref.rollout.agent.agent_loop_config_path=loops.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["multi_turn"]["agent_loops"] == [
        {"name": "check_again_agent", "component": "verl", "options": {"verl_class": "my_pkg.loops.CheckAgainAgentLoop"}},
        {
            "name": "search_agent",
            "component": "verl",
            "options": {"verl_class": "my_pkg.loops.SearchAgentLoop", "kwargs": {"max_searches": 3, "engine": {"url": "http://127.0.0.1:8000"}}},
        },
    ]
    assert "agent_loop_config_path" not in out.stderr

    key = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
    why = {k: reason for k, _, reason in convert(read_verl([*base, multi_turn, f"{key}={tmp_path / 'gone.yaml'}"])).unmapped}
    assert why[key] == f"cannot read '{tmp_path / 'gone.yaml'}' (FileNotFoundError); copy its entries into multi_turn.agent_loops by hand"
    why = {k: reason for k, _, reason in convert(read_verl([*base, f"{key}={tmp_path / 'loops.yaml'}"])).unmapped}
    assert why[key].startswith("trellis runs agent loops in multi-turn runs only; set actor_rollout_ref.rollout.multi_turn.enable=true")
    (tmp_path / "flat.yaml").write_text("name: one\n_target_: my_pkg.loops.One\n")
    conversion = convert(read_verl([*base, multi_turn, f"{key}={tmp_path / 'flat.yaml'}"]))
    assert "agent_loops" not in conversion.config["multi_turn"]
    assert {k: reason for k, _, reason in conversion.unmapped}[key].endswith("is not a list of entries with a name and a _target_ (verl's layout)")


def test_verl_async_keys_without_the_async_entry_point_are_named_with_the_entry_that_reads_them():
    """verl's fully-async keys act only under its fully-async entry point (and the v1 async trainers
    bound staleness otherwise): given as plain keys for main_ppo, each is reported with where it
    acts, and the values that are what trellis does anyway (sync, no partial rollout) pass silently."""
    given = [
        "actor_rollout_ref.model.path=/models/base",
        "trainer.total_training_steps=5",
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.sampler.max_off_policy_threshold=2",
        "trainer.v1.separate_async.parameter_sync_step=4",
        "async_training.staleness_threshold=0.1",
        "async_training.partial_rollout=true",
        "async_training.trigger_parameter_sync_step=4",
        "rollout.nnodes=1",
    ]
    conversion = convert(read_verl(given))
    why = {k: reason for k, _, reason in conversion.unmapped}
    assert set(why) == {g.split("=")[0] for g in given[2:]}
    assert "trainer.async_mode=one_step, or fully_async with trainer.max_staleness" in why["trainer.v1.trainer_mode"]
    assert "trainer.max_staleness with trainer.async_mode=fully_async" in why["trainer.v1.sampler.max_off_policy_threshold"]
    for key in ("async_training.staleness_threshold", "async_training.partial_rollout", "async_training.trigger_parameter_sync_step"):
        assert why[key].startswith("read by verl's fully-async trainer only, which its entry point chooses"), why[key]
    assert "trainer.rollout_pool=N" in why["rollout.nnodes"]
    assert "async_mode" not in conversion.config.get("trainer", {})
    silent = convert(read_verl([*given[:2], "trainer.v1.trainer_mode=sync", "async_training.partial_rollout=false"]))
    assert silent.unmapped == []


@pytest.mark.parametrize(
    ("overrides", "replay", "unmapped"),
    [
        (["actor_rollout_ref.rollout.enable_rollout_routing_replay=True", "actor_rollout_ref.actor.megatron.router_replay.mode=R3"], "rollout", None),
        (["actor_rollout_ref.rollout.enable_rollout_routing_replay=True"], "measure", None),
        (["actor_rollout_ref.actor.veomni.router_replay.mode=disabled"], None, None),
        (["actor_rollout_ref.actor.megatron.router_replay.mode=R2"], None, "replays the trainer's own routing"),
    ],
    ids=["R3", "recorded-only", "disabled", "R2"],
)
def test_verls_routing_replay_keys_convert_to_actor_router_replay(overrides, replay, unmapped):
    given = read_verl(["data.train_files=/nowhere/train.parquet", "trainer.total_training_steps=2", *overrides])
    conversion = convert(given, load_plugins().registry)
    assert conversion.config.get("actor", {}).get("router_replay") == replay
    why = {key: reason for key, _, reason in conversion.unmapped}
    if unmapped is None:
        assert not [k for k in why if "router" in k or "routing" in k]
    else:
        assert unmapped in why["actor_rollout_ref.actor.megatron.router_replay.mode"]
