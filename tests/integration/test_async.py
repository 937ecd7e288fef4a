"""Generation ahead of training (``trainer.async_mode``) on the tiny model: staleness 0 is the
synchronous run bit for bit, one step ahead lags one weight version, and a run killed while the
producer is ahead resumes with every prompt trained exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trellis.config import ConfigError
from trellis.recipes.train import train
from trellis_algos.rl.ahead import ProducerFailed

KILLABLE = Path(__file__).with_name("killable.py")
# figures that depend on the clock, or exist only where generation runs ahead (or the engine has its own weights)
NOT_COMPARED = ("timing/", "async/", "rollout/staleness", "sync/", "memory/")


# a reward that differs between the samples of a prompt from the first step on (the tiny model is random)
LENGTH_REWARD = """
def by_length(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 10
"""


@pytest.fixture
def with_signal(tmp_path):
    (tmp_path / "by_length.py").write_text(LENGTH_REWARD)
    return (f"reward.path={tmp_path / 'by_length.py'}", "reward.name=by_length")


def step_rows(rows):
    return [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in rows]


def trained_prompts(run_dir: Path) -> list[list[str]]:
    """Per step, the logged prompts (every sample of the step: ``trainer.log_samples`` is large)."""
    steps: dict[int, list[str]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["split"] == "train":
            steps.setdefault(row["step"], []).append(row["prompt"])
    return [steps[s] for s in sorted(steps)]


def test_staleness_zero_equals_the_synchronous_run_bit_for_bit(run_rl, tmp_path, with_signal):
    # one thread in both runs ("auto" follows the machine's load): the off run's engine generates from the actor's module,
    # the other's from a copy, and their log-probs agree to the last bit only at the same thread count
    common = ("trainer.total_steps=3", "trainer.val_every_steps=2", "trainer.save_hf_model=true", "trainer.threads=1", *with_signal)
    _, off = run_rl(*common, "trainer.async_mode=off", run_dir=tmp_path / "off")  # YAML reads off as false: the word comes back
    _, ahead = run_rl(*common, "trainer.async_mode=fully_async", "trainer.max_staleness=0", run_dir=tmp_path / "ahead")
    assert step_rows(ahead) == step_rows(off)
    assert [r["rollout/staleness_max"] for r in ahead if "rollout/staleness_max" in r] == [0.0, 0.0, 0.0]
    assert all(r["actor/grad_norm"] > 0 for r in off if "actor/grad_norm" in r)  # the weights moved every step
    weights = [load_file(tmp_path / run / "hf_model" / "model.safetensors") for run in ("off", "ahead")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_one_step_ahead_trains_the_same_prompts_on_samples_one_version_old(run_rl, tmp_path, with_signal):
    common = ("trainer.total_steps=3", "trainer.log_samples=16", *with_signal)
    _, off = run_rl(*common, run_dir=tmp_path / "off")
    _, ahead = run_rl(*common, "trainer.async_mode=one_step", run_dir=tmp_path / "ahead")
    steps = [r for r in ahead if "rollout/staleness_max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[0]["rollout/staleness_max"] == 0.0  # the first step's samples come from the initial weights
    assert all(r["rollout/staleness_max"] <= 1.0 for r in steps)
    assert sum(r["rollout/staleness_mean"] for r in steps) > 0  # later steps trained on samples of older weights
    assert trained_prompts(tmp_path / "ahead") == trained_prompts(tmp_path / "off")


SLOW_REWARD = """
import time


def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.05)  # a step's samples take longer to score than to train on
    return len(solution_str) / 10
"""


@pytest.mark.parametrize("staleness", [1, 2])
def test_the_exact_schedule_generates_each_step_from_the_weights_s_versions_back(run_rl, tmp_path, staleness):
    """trainer.async_schedule=exact (the default): step t generates from exactly the weights of step
    t-1-s, whatever the timing: every sample of step t is min(s, t-1) versions old. With scoring
    slower than training, the opportunistic schedule takes the newer weights synced meanwhile
    (measured, s=2: staleness 0, 1, 1, 1, 1)."""
    (tmp_path / "slow.py").write_text(SLOW_REWARD)
    slow = (f"reward.path={tmp_path / 'slow.py'}", "reward.name=slow")
    common = ("trainer.total_steps=5", "trainer.async_mode=fully_async", f"trainer.max_staleness={staleness}", "data.val_path=null", *slow)
    _, rows = run_rl(*common)
    exact = [float(min(staleness, t - 1)) for t in range(1, 6)]
    assert [r["rollout/staleness_max"] for r in rows if "rollout/staleness_max" in r] == exact
    assert [r["rollout/staleness_mean"] for r in rows if "rollout/staleness_mean" in r] == exact
    _, rows = run_rl(*common, "trainer.async_schedule=opportunistic", run_dir=tmp_path / "opportunistic")
    assert all(r["rollout/staleness_max"] <= staleness for r in rows if "rollout/staleness_max" in r)


def test_a_bfloat16_trainer_one_step_ahead_of_a_float32_engine_trains(run_rl, tmp_path, with_signal):
    """The sync checks bound the gap by the lower precision of both sides: bfloat16 rounding passes.
    Step 1's samples come from the weights the trainer holds (the batch gap is checked); later
    steps' are a version old (not rounding: reported only where fresh samples exist)."""
    _, rows = run_rl("trainer.total_steps=3", "backend.dtype=bfloat16", "trainer.async_mode=one_step", *with_signal)
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(0 < r["sync/probe_gap"] < 0.1 for r in steps)
    assert 0 < steps[0]["sync/batch_gap"] < 0.1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.max_staleness=2"], "trainer.max_staleness' is 2 with trainer.async_mode=off"),
        (["trainer.async_mode=one_step", "trainer.max_staleness=3"], "use trainer.async_mode=fully_async"),
        (["trainer.async_mode=fuly_async"], "fully_async"),
        (["trainer.async_mode=one_step", "trainer.partial_rollout=true"], "only generation that runs ahead of training is cut"),
        (["trainer.rollout_chunk_tokens=8"], "trainer.rollout_chunk_tokens' is 8 with trainer.partial_rollout=false"),
        (["trainer.async_mode=fully_async", "trainer.partial_rollout=true"], "partial_rollout' is true with trainer.async_schedule=exact"),
    ],
)
def test_async_settings_that_cannot_apply_are_refused_by_name(run_rl, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_rl(*overrides)


def test_a_run_killed_while_generating_ahead_resumes_with_every_prompt_trained_once(run_rl, tiny_model_path, data_files, tmp_path, with_signal):
    """Killed inside step 3's update, when step 4's prompts were already fetched (one step ahead):
    checkpoint 2 keeps the loader after step 2's prompts, so the resumed run trains steps 3 and 4
    on the prompts an uninterrupted run trains, none twice and none lost."""
    common = ("trainer.total_steps=4", "trainer.log_samples=16", "trainer.save_every_steps=2", *with_signal)
    _, off = run_rl(*common, run_dir=tmp_path / "off")
    run_dir = tmp_path / "ahead"
    overrides = [
        "recipe=rl", f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}", "data.train_batch_prompts=4",
        "sampling.n=4", "sampling.max_new_tokens=6", "actor.micro_batch_samples=8", "actor.optim.lr=1e-3", "trainer.trackers=[jsonl]",
        "trainer.async_mode=one_step", f"trainer.run_dir={run_dir}", *common,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(KILLABLE), "update", "3", *overrides], env=env, capture_output=True, text=True)
    assert proc.returncode < 0, proc.stderr[-3000:]
    assert (run_dir / "checkpoint-2").is_dir() and not (run_dir / "checkpoint-4").exists()
    train(None, overrides)
    assert trained_prompts(run_dir) == trained_prompts(tmp_path / "off")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "rollout/staleness_max" in r] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "mode",
    [
        ("trainer.async_mode=one_step",),
        ("trainer.async_mode=fully_async", "trainer.max_staleness=1"),
        ("trainer.async_mode=fully_async", "trainer.max_staleness=2"),
        ("trainer.async_mode=fully_async", "trainer.max_staleness=2", "algorithm.dynamic_sampling.enable=true"),
    ],
    ids=["one_step", "s1", "s2", "s2-dynamic-sampling"],
)
def test_async_runs_are_bit_identical_run_to_run_and_after_a_kill(tiny_model_path, data_files, tmp_path, with_signal, mode):
    """The exact schedule: two runs with one seed log the same figures and end with the same
    weights, and so does a run killed inside step 4's update and resumed from checkpoint 2, whose
    steps made ahead (generated from weights the resume no longer has) the checkpoint keeps."""

    def overrides(run: str) -> list[str]:
        return [
            "recipe=rl", f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}", f"data.val_path={data_files['test']}",
            "data.train_batch_prompts=4", "sampling.n=4", "sampling.max_new_tokens=6", "actor.micro_batch_samples=8", "actor.optim.lr=1e-3",
            "trainer.trackers=[jsonl]", "trainer.total_steps=5", "trainer.save_every_steps=2", "trainer.val_every_steps=2",
            "trainer.save_hf_model=true", "trainer.threads=1", f"trainer.run_dir={tmp_path / run}", *with_signal, *mode,
        ]  # fmt: skip

    def figures(run: str) -> list[dict]:
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(("timing/", "memory/", "async/"))} for r in rows]

    train(None, overrides("first"))
    train(None, overrides("second"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(KILLABLE), "update", "4", *overrides("killed")], env=env, capture_output=True, text=True)
    assert proc.returncode < 0, proc.stderr[-3000:]
    assert (tmp_path / "killed" / "checkpoint-2").is_dir() and not (tmp_path / "killed" / "checkpoint-4").exists()
    train(None, overrides("killed"))

    first = figures("first")
    assert sum(r.get("rollout/staleness_mean", 0) for r in first) > 0  # later steps trained on older samples
    assert figures("second") == first
    assert figures("killed") == first
    weights = [load_file(tmp_path / run / "hf_model" / "model.safetensors") for run in ("first", "second", "killed")]
    assert all(torch.equal(weights[0][k], other[k]) for other in weights[1:] for k in weights[0])


@pytest.fixture
def actor_and_own_rollout(tiny_model_path, data_files):
    """The FSDP actor (world 1) and an HF engine with weights of its own beside it."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from trellis.config import validate
    from trellis.data import load_rows
    from trellis.interfaces.rollout import RolloutSpec
    from trellis.plugins import load_plugins
    from trellis.runtime.controller import LocalRollout, LocalWorkerGroup
    from trellis.runtime.worker import build_worker
    from trellis_algos import ActorConfig, PromptDataset
    from trellis_hf.engine import make_engine

    registry = load_plugins().registry
    options = validate(OmegaConf.create({"optim": {"lr": 1e-2}, "micro_batch_samples": 8}), ActorConfig, registry)
    actor = LocalWorkerGroup("actor", build_worker(registry, "fsdp", "actor", tiny_model_path, options, {"update": "policy"}))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rollout = LocalRollout(make_engine(RolloutSpec(tiny_model_path, None, tokenizer)), actor, adopt=False)
    prompts = PromptDataset(load_rows(data_files["train"])[:4], tokenizer, 32).as_batch()
    return actor, rollout, prompts, tokenizer


def test_a_generation_cut_for_a_sync_continues_under_the_new_weights(actor_and_own_rollout, tiny_model_path):
    """A 12-token generation in chunks of 4; between the first two chunks the actor trains and the
    weights are synced (version 1). Tokens after the sync carry version 1 and their log-probs are
    the new weights' (a forward of the trained actor); the first chunk's are the old weights'."""
    from trellis.interfaces.rollout import SamplingParams, pad_id, stop_ids
    from trellis_algos.rl.partial import generate_in_chunks, version_span

    actor, rollout, prompts, tokenizer = actor_and_own_rollout
    synced = []

    def train_and_sync():
        if synced:
            return
        batch = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=9))
        batch["old_log_probs"] = actor.log_prob(batch)["log_probs"]
        batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
        actor.train("update", batch)
        rollout.sync_weights(version=1)
        synced.append(True)

    params = SamplingParams(n=2, max_new_tokens=12, seed=3)
    out = generate_in_chunks(rollout, prompts, params, 4, stop_ids(tiny_model_path, tokenizer), pad_id(tokenizer), train_and_sync)
    mask = out["response_mask"].bool()
    assert synced and out["responses"].shape[0] == 8 and mask.sum(-1).max() > 4  # generations went past the first chunk
    versions = out["token_versions"]
    assert (versions[:, :4][mask[:, :4]] == 0).all() and (versions[:, 4:][mask[:, 4:]] == 1).all()
    assert (out["weight_version"] == 0).all()  # a sample's version is its oldest token's
    now = actor.log_prob(out)["log_probs"]
    after = mask.clone()
    after[:, :4] = False
    torch.testing.assert_close(out["rollout_log_probs"][after], now[after], atol=1e-5, rtol=0)
    before = mask.clone()
    before[:, 4:] = False
    assert (out["rollout_log_probs"][before] - now[before]).abs().max() > 1e-3  # the first chunk came from the old weights
    span = version_span(out)
    assert span["rollout/version_span_max"] == 1.0 and span["rollout/partial_frac"] == float((mask.sum(-1) > 4).float().mean())


def test_partial_rollouts_run_ahead_within_the_staleness_bound(run_rl, tmp_path, with_signal):
    _, rows = run_rl(
        "trainer.total_steps=3", "sampling.max_new_tokens=16", "trainer.async_mode=fully_async", "trainer.max_staleness=1",
        "trainer.partial_rollout=true", "trainer.async_schedule=opportunistic", "trainer.rollout_chunk_tokens=4", *with_signal,
    )  # fmt: skip
    steps = [r for r in rows if "rollout/staleness_max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["rollout/staleness_max"] <= 1.0 and 0.0 <= r["rollout/version_span_max"] <= 1.0 for r in steps)
    assert all(r["sync/probe_gap"] < 1e-3 for r in steps)


FAILING_REWARD = """
calls = []


def fails_later(data_source, solution_str, ground_truth, extra_info=None):
    calls.append(1)
    if len(calls) > 16:  # the second step's samples (4 prompts x 4)
        raise ValueError("the grader crashed")
    return len(solution_str) / 10
"""


def test_a_failure_while_generating_ahead_stops_the_run_naming_the_step(run_rl, tmp_path):
    (tmp_path / "fails_later.py").write_text(FAILING_REWARD)
    overrides = ("trainer.total_steps=3", "trainer.async_mode=one_step", f"reward.path={tmp_path / 'fails_later.py'}", "reward.name=fails_later")
    with pytest.raises(ProducerFailed, match="generating the samples of step 2 ahead of training failed") as err:
        run_rl(*overrides, "reward.max_error_rate=0", "validation.before_train=false")
    assert type(err.value.__cause__).__name__ == "RewardError" and "fails_later" in str(err.value.__cause__)
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]  # the step before trained and was logged; nothing hangs
