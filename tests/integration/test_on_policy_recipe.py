"""The rl recipe's on-policy shortcut end to end: with one update per batch it skips the
old-log-prob pass (the actor's update takes them from its first forward) and trains exactly as
the run that makes the pass (forced here by switching the recipe's decision off)."""

from __future__ import annotations

import pytest

from trellis_algos import rl
from trellis_algos.rl import learner
from trellis_algos.rl.checks import needs, on_policy_update

# a reward that differs between samples of a prompt, so advantages and gradients are not 0
VARIED_REWARD = """
def varied(data_source, solution_str, ground_truth, extra_info=None):
    return (len(solution_str) * 7 + sum(map(ord, solution_str))) % 11 / 10
"""


def numbers(rows):
    """Every step's metrics but timings (which differ from run to run)."""
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in rows]


@pytest.mark.parametrize("overrides", [[], ["actor.entropy_coeff=0.01", "actor.max_tokens_per_micro_batch=48"]], ids=["default", "entropy+budget"])
def test_on_policy_run_equals_the_run_with_an_old_log_prob_pass(run_rl, tmp_path, monkeypatch, overrides):
    reward = tmp_path / "varied.py"
    reward.write_text(VARIED_REWARD)
    args = ["trainer.threads=1", "validation.before_train=false", f"reward.path={reward}", "reward.name=varied", *overrides]
    _, fast = run_rl(*args, run_dir=tmp_path / "fast")
    monkeypatch.setattr(learner, "on_policy_update", lambda *a: False)
    _, slow = run_rl(*args, run_dir=tmp_path / "slow")
    steps = [r for r in fast if "reward/mean" in r]
    assert len(steps) == 2 and all("timing/old_log_prob_s" not in r for r in steps)
    assert all("timing/old_log_prob_s" in r for r in slow if "reward/mean" in r)
    assert all(r["actor/grad_norm"] > 0 for r in steps)
    for got, expected in zip(numbers(fast), numbers(slow)):
        # the entropy is summed per micro-batch in float64 by the update, over the batch in float32 by the pass
        assert got.pop("actor/entropy", 0.0) == pytest.approx(expected.pop("actor/entropy", 0.0), rel=1e-6)
        # the agreement check reads the update's per-micro-batch mean here, the pass's batch mean there
        assert got.pop("sync/batch_gap", 0.0) == pytest.approx(expected.pop("sync/batch_gap", 0.0), abs=1e-7)
        assert got == expected


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], True),
        (["actor.mini_batch_samples=16"], True),  # the whole step: still one update
        (["actor.mini_batch_samples=8"], False),
        (["actor.ppo_epochs=2"], False),
        (["algorithm.use_kl_in_reward=true"], False),
        (["algorithm.advantage.name=optimal_token_baseline"], False),
        (["actor.policy_loss.rollout_is=token"], False),
    ],
)
def test_the_shortcut_is_taken_only_when_exact(overrides, expected):
    from omegaconf import OmegaConf

    from trellis.config import validate
    from trellis.plugins import load_plugins

    registry = load_plugins().registry
    cfg = validate(OmegaConf.merge(OmegaConf.structured(rl.RLConfig), OmegaConf.from_dotlist(overrides)), rl.RLConfig, registry)
    assert on_policy_update(cfg, registry, needs(registry, cfg.algorithm.advantage.name), samples=16) is expected
