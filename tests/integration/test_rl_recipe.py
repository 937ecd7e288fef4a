"""The rl recipe end to end on a tiny model: every estimator and policy loss runs from config alone,
bad configs fail before any model is built, and the rollout tracks the actor's weights."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from transformers import AutoTokenizer

from trellis.batch import Batch
from trellis.config import ConfigError
from trellis.data import load_rows
from trellis.interfaces.rollout import RolloutSpec, SamplingParams
from trellis.plugins import load_plugins
from trellis.recipes.train import train
from trellis_algos import PromptDataset

STEP_KEYS = {
    "reward/mean", "actor/entropy", "actor/pg_loss", "response/length_mean", "timing/step_s",
    "timing/gen_s", "timing/reward_s", "timing/adv_s", "timing/update_actor_s", "timing/weight_sync_s",
}  # fmt: skip


def train_steps(rows):
    return [r for r in rows if "reward/mean" in r]


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.advantage.name=grpo"],
        ["algorithm.advantage.name=grpo", "algorithm.advantage.norm_by_std=false", "actor.loss_agg_mode=seq-mean-token-sum-norm"],
        ["algorithm.advantage.name=gae", "critic.micro_batch_samples=8"],
        ["algorithm.advantage.name=rloo"],
        ["algorithm.advantage.name=reinforce_plus_plus"],
        ["algorithm.advantage.name=reinforce_plus_plus_baseline"],
        ["algorithm.advantage.name=remax"],
        ["algorithm.advantage.name=opo"],
        ["algorithm.advantage.name=gpg"],
        ["algorithm.advantage.name=optimal_token_baseline"],  # needs sum_sq_probs from the forward
        ["algorithm.advantage.name=tir_optimal_token_baseline", "algorithm.advantage.handle_zero_tail=false"],
        ["actor.policy_loss.name=clip_cov"],
        ["actor.policy_loss.name=kl_cov"],
        ["actor.policy_loss.name=gspo"],
        ["actor.policy_loss.name=cispo"],
        ["actor.policy_loss.name=gmpo"],
        ["actor.policy_loss.name=reinforce"],
        ["actor.use_kl_loss=true", "actor.kl_loss_type=k3+", "actor.entropy_coeff=0.01"],
        ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl_type=adaptive", "actor.ppo_epochs=2", "actor.mini_batch_samples=8"],
    ],
    ids=lambda o: " ".join(x.split("=", 1)[1] for x in o),
)
def test_two_step_run_from_config(run_rl, overrides):
    summary, rows = run_rl(*overrides)
    steps = train_steps(rows)
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        missing = STEP_KEYS - set(row)
        assert not missing, missing
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
    if not any(o.startswith("actor.policy_loss.name=") for o in overrides):  # vanilla PPO clip
        assert 0.0 <= steps[0]["actor/clip_frac"] <= 1.0
    assert rows[0] == {"step": 0, **{f"val/{k}": v for k, v in summary["val_before"].items()}}
    assert 0.0 <= summary["val_after"]["reward_mean"] <= 1.0
    if "algorithm.advantage.name=gae" in overrides:
        assert "critic/vf_loss" in steps[0] and "timing/values_s" in steps[0]
    if "actor.use_kl_loss=true" in overrides:
        assert "actor/kl_loss" in steps[0] and "timing/ref_s" in steps[0]
        assert steps[0]["actor/kl"] == steps[0]["actor/kl_loss"]
    if "algorithm.use_kl_in_reward=true" in overrides:
        assert steps[0]["actor/kl"] == steps[0]["actor/reward_kl"]


@pytest.fixture
def no_model_building(monkeypatch):
    """Fail the test if the recipe gets as far as building a worker."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the config error was found")

    monkeypatch.setattr("trellis.runtime.harness.spawn_worker", refuse)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.advantage.name=grpoo", r"config key 'algorithm.advantage.name': advantage 'grpoo' is not installed.*did you mean 'grpo'"),
        ("sampling.n=four", r"config key 'sampling.n' has value 'four' but expects type int"),
        ("data.train_path=/nowhere/train.parquet", r"config key 'data.train_path': file '/nowhere/train.parquet' does not exist"),
        ("actor.mini_batch_samples=5", r"config key 'actor.mini_batch_samples' is 5, but a step has .* = 16 samples; choose a divisor of 16"),
        ("actor.loss_agg_mode=token_mean", r"'actor.loss_agg_mode' is 'token_mean'; valid values: token-mean, .*; did you mean 'token-mean'\?"),
        ("rollout.name=vllm", r"rollout 'vllm' is not installed: pip install trellis-rollout-vllm"),
    ],
)
def test_bad_config_fails_before_any_model_is_built(run_rl, no_model_building, override, message):
    with pytest.raises(ConfigError, match=message):
        run_rl(override)


@pytest.fixture
def actor_and_rollout(tiny_model_path, data_files):
    from omegaconf import OmegaConf

    from trellis.config import validate
    from trellis.runtime.worker import build_worker
    from trellis_algos import ActorConfig
    from trellis_hf.engine import make_engine

    registry = load_plugins().registry
    options = validate(OmegaConf.create({"optim": {"lr": 1e-2}, "micro_batch_samples": 8}), ActorConfig, registry)
    actor = build_worker(registry, "fsdp", "actor", tiny_model_path, options, {"update": "policy"})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rollout = make_engine(RolloutSpec(tiny_model_path, None, tokenizer))
    prompts = PromptDataset(load_rows(data_files["train"])[:6], tokenizer, 32).as_batch()
    return actor, rollout, prompts


def test_backend_log_prob_equals_rollout_log_probs(actor_and_rollout):
    actor, rollout, prompts = actor_and_rollout
    out = rollout.generate(prompts, SamplingParams(n=3, temperature=0.8, max_new_tokens=8, seed=0))
    lp = actor.log_prob(out)["log_probs"] * out["response_mask"]
    torch.testing.assert_close(lp, out["rollout_log_probs"], atol=1e-5, rtol=0)


def test_rollout_follows_actor_after_update_and_sync(actor_and_rollout):
    actor, rollout, prompts = actor_and_rollout
    params = SamplingParams(n=2, max_new_tokens=8, seed=1)
    out = rollout.generate(prompts, params)
    out["old_log_probs"] = actor.log_prob(out)["log_probs"]
    out["advantages"] = torch.linspace(-1, 1, len(out))[:, None] * out["response_mask"]
    actor.train("update", out)
    before_sync = rollout.generate(prompts, params)
    new_lp = actor.log_prob(before_sync)["log_probs"] * before_sync["response_mask"]
    assert (new_lp - before_sync["rollout_log_probs"]).abs().max() > 1e-3  # the actor moved, the rollout did not
    rollout.load_weights(w for bucket in actor.export_weights() for w in bucket)
    after = rollout.generate(prompts, params)
    torch.testing.assert_close(actor.log_prob(after)["log_probs"] * after["response_mask"], after["rollout_log_probs"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["fsdp", "plain"])
def test_sft_recipe_with_dft_loss_saves_loadable_model(tiny_model_path, data_files, tmp_path, backend):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "sft"
    train(
        None,
        [
            "recipe=sft",
            f"model.path={tiny_model_path}",
            f"data.train_path={data_files['train']}",
            f"data.val_path={data_files['test']}",
            "data.batch_samples=16",
            "train.loss.name=dft",
            "train.optim.lr=1e-2",
            f"backend.name={backend}",
            "trainer.total_steps=3",
            "trainer.trackers=[jsonl]",
            "trainer.save_hf_model=true",
            f"trainer.run_dir={run_dir}",
        ],
    )
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3 and "val/loss" in rows[-1]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model")
    assert model.config.vocab_size == AutoTokenizer.from_pretrained(run_dir / "hf_model").vocab_size or model is not None
    assert (run_dir / "config.yaml").read_text().count("name: dft") == 1


def test_sft_data_without_messages_or_prompt_is_refused_naming_the_sft_rows(tiny_model_path, tmp_path):
    """A file with neither chat messages nor a prompt stops the dry run naming what the sft recipe
    reads (it recommended verl's RL schema)."""
    from trellis.data import DataError
    from trellis_demo.tasks import write_rows

    path = write_rows([{"question": "1+1=", "answer": "2"}], tmp_path / "qa.jsonl")
    with pytest.raises(DataError) as refused:
        train(None, ["recipe=sft", f"model.path={tiny_model_path}", f"data.train_path={path}", f"trainer.run_dir={tmp_path / 'run'}"], dry_run=True)
    assert str(refused.value) == (
        f"data file {str(path)!r}: row 0 has no column 'prompt' (columns: ['answer', 'question']); add it to every row (the sft "
        "recipe's rows: chat messages (loss on the assistant turns), or a prompt plus its target in data.response_key)"
    )


@pytest.mark.parametrize(
    "overrides",
    [["algorithm.advantage.name=grpo", "actor.entropy_coeff=0.01"], ["algorithm.advantage.name=gae"], ["algorithm.use_kl_in_reward=true"]],
    ids=["grpo", "gae", "kl_in_reward"],
)
def test_tests_only_plain_backend_runs_the_recipe_like_fsdp(run_rl, overrides, tmp_path):
    """The plain backend (tests/plugins/plain: no FSDP, no loss code) trains through the same
    recipe to the same numbers as FSDP on one rank."""
    _, fsdp = run_rl(*overrides)
    _, plain = run_rl(*overrides, "backend.name=plain", run_dir=tmp_path / "plain")
    assert [r["step"] for r in plain] == [r["step"] for r in fsdp]
    for got, expected in zip(train_steps(plain), train_steps(fsdp)):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "actor/reward_kl"):
            if key in expected:
                assert got[key] == pytest.approx(expected[key], abs=1e-5), key


def test_samples_carry_their_prompt_uid_and_weight_version(run_rl, monkeypatch):
    """Advantages are grouped by the prompt's uid (not by position) and every sample records the
    weight version that generated it: 0 before the first update, then the step that synced."""
    from trellis_algos.rl import learner

    seen = []
    compute = learner.compute_advantages

    def spy(batch, *args):
        seen.append((list(batch["uid"]), batch["weight_version"].tolist()))
        batch["token_scores"] = torch.randn(len(batch), 1) * batch["response_mask"]  # the tiny model scores 0 everywhere
        perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(0))
        shuffled = batch.reorder(perm)
        compute(shuffled, *args)
        metrics = compute(batch, *args)
        torch.testing.assert_close(shuffled["advantages"], batch["advantages"][perm])  # same groups in any order
        assert batch["advantages"].abs().sum() > 0
        return metrics

    monkeypatch.setattr(learner, "compute_advantages", spy)
    run_rl()
    (uids1, v1), (uids2, v2) = seen
    assert v1 == [0] * len(v1) and v2 == [1] * len(v2)
    assert len(set(uids1)) == 4 and all(list(uids1).count(u) == 4 for u in set(uids1)) and not set(uids1) & set(uids2)


def test_async_generation_reaches_the_engine_through_the_local_controller(tiny_model_path):
    """``RolloutGroup.agenerate``, the multi-turn loop's entry, under the local controller:
    concurrent samples, each the tokens that batch generation gives the same prompt."""
    import asyncio

    from trellis.runtime.controller import LocalController
    from trellis_hf.engine import make_engine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rollout = LocalController().spawn_rollout(lambda: make_engine(RolloutSpec(tiny_model_path, None, tokenizer)), actor=None)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("12+7=", "3+4=")]
    params = SamplingParams(max_new_tokens=5, greedy=True)

    async def both():
        return await asyncio.gather(*(rollout.agenerate(p, params) for p in prompts))

    got = asyncio.run(both())
    for prompt, sample in zip(prompts, got):
        batch = rollout.generate(Batch({"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, len(prompt), dtype=torch.long)}), params)
        assert sample.token_ids == batch["responses"][0][batch["response_mask"][0].bool()].tolist()
        assert len(sample.log_probs) == len(sample.token_ids) > 0 and batch["weight_version"].tolist() == [0]


GRADED_REWARD = '''
from trellis_algos import gsm8k_score


def graded(data_source, solution_str, ground_truth, extra_info=None):
    """Two components: a right answer, and a short response (for gdpo)."""
    right = gsm8k_score(data_source, solution_str, ground_truth)
    short = 1.0 if len(solution_str) <= 8 else 0.0
    return {"score": right + short, "right": right, "short": short}
'''


def test_gdpo_gets_the_rewards_components_through_the_recipe(run_rl, tmp_path):
    reward = tmp_path / "graded.py"
    reward.write_text(GRADED_REWARD)
    summary, rows = run_rl(
        "algorithm.advantage.name=gdpo", "algorithm.advantage.reward_keys=right,short", "algorithm.advantage.reward_weights=1.0,0.5",
        f"reward.path={reward}", "reward.name=graded",
    )  # fmt: skip
    steps = train_steps(rows)
    assert [r["step"] for r in steps] == [1, 2]
    # the reward's components reach the metrics and gdpo (an unknown key would stop the run)
    assert all(0.0 <= r["reward/short"] <= 1.0 and "reward/right" in r for r in steps)
    assert all(math.isfinite(r["actor/pg_loss"]) for r in steps)


def test_a_run_without_reward_signal_says_so(run_rl, tmp_path, caplog):
    """A reward that scores every sample alike (as the starter's gsm8k does on other data): each
    step logs reward/groups_with_signal=0 and the actor's gradient is exactly 0; both are warned of."""
    reward = tmp_path / "zero.py"
    reward.write_text("def zero(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    with caplog.at_level(logging.WARNING, logger="trellis"):
        _, rows = run_rl(f"reward.path={reward}", "reward.name=zero")
    steps = [r for r in rows if "actor/grad_norm" in r]
    assert [r["reward/groups_with_signal"] for r in steps] == [0.0, 0.0] and all(r["actor/grad_norm"] == 0.0 for r in steps)
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1:")]
    assert any("every prompt's samples got the same reward" in m for m in warned), warned
    assert any("actor/grad_norm=0: the gradient is exactly zero" in m for m in warned), warned


def test_the_engine_trainer_gap_is_logged_by_default(run_rl):
    """Without any rollout-correction option, every update reports how far the engine that sampled
    is from the trainer on the step's own tokens: near 0 when the sync works (HF engine, fp32)."""
    _, rows = run_rl()
    for row in (r for r in rows if "actor/pg_loss" in r):
        assert abs(row["actor/rollout_corr/kl"]) < 1e-4 and abs(row["actor/rollout_corr/log_ppl_diff"]) < 1e-4, row
        assert "actor/rollout_corr/chi2_token" in row


@pytest.mark.parametrize(("advantage", "warns"), [("grpo", True), ("gae", False)], ids=["grpo", "gae"])
def test_the_no_reward_signal_warning_is_for_group_relative_estimators(run_rl, caplog, advantage, warns):
    """Every reward is 0 (a random model on arithmetic): GRPO's advantages are all 0 and the run says
    so; a critic's values give GAE advantages whatever the rewards, so it must not."""
    with caplog.at_level(logging.WARNING, logger="trellis"):
        _, rows = run_rl(f"algorithm.advantage.name={advantage}", "critic.micro_batch_samples=8")
    assert all(r["reward/groups_with_signal"] == 0.0 for r in train_steps(rows))
    said = [r.getMessage() for r in caplog.records if "the policy learns nothing" in r.getMessage()]
    assert bool(said) == warns, said
