"""The run's zero-signal warnings: said at the first step a role's gradient is exactly 0 or no prompt
group's samples differ in reward, then every 10th step while it lasts; nothing when the run learns."""

from __future__ import annotations

import logging

from trellis.runtime.signals import SignalWatch


def test_warnings_first_then_every_tenth_step_while_it_lasts(caplog):
    watch = SignalWatch(every=10)
    dead = {"actor/grad_norm": 0.0, "reward/groups_with_signal": 0.0, "reward/mean": 0.0}
    with caplog.at_level(logging.WARNING, logger="trellis"):
        said = [len(watch.check(step, dead)) for step in range(1, 22)]
    assert said == [2] * 21  # every step has both problems
    steps = [r.getMessage().split(":")[0] for r in caplog.records]
    assert steps == ["step 1", "step 1", "step 11", "step 11", "step 21", "step 21"]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "actor/grad_norm=0: the gradient is exactly zero" in messages and "(11 steps in a row)" in messages
    assert "every prompt's samples got the same reward (reward/mean=0.000)" in messages and "reward.name" in messages


def test_a_learning_step_resets_the_streak_and_says_nothing(caplog):
    watch = SignalWatch(every=10)
    with caplog.at_level(logging.WARNING, logger="trellis"):
        watch.check(1, {"actor/grad_norm": 0.0})
        assert watch.check(2, {"actor/grad_norm": 0.3, "reward/groups_with_signal": 0.5}) == []
        watch.check(3, {"actor/grad_norm": 0.0})
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["step 1", "step 3"]


def test_without_watch_reward_equal_rewards_say_nothing_but_a_zero_gradient_still_does(caplog):
    watch = SignalWatch(every=10, watch_reward=False)  # as the rl recipe sets it for a teacher's advantage
    with caplog.at_level(logging.WARNING, logger="trellis"):
        assert watch.check(1, {"actor/grad_norm": 0.4, "reward/groups_with_signal": 0.0, "reward/mean": 0.0}) == []
        assert len(watch.check(2, {"actor/grad_norm": 0.0, "reward/groups_with_signal": 0.0})) == 1
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["step 2"]
    assert "actor/grad_norm=0" in caplog.records[0].getMessage()
