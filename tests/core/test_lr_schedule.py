"""The learning-rate schedule's warm-up, against its formula: step ``s`` (0-based) of ``W``
warm-up steps at ``(s + 1) / W`` of the base rate, or ``s / W`` with ``warmup_from_zero`` (the
Hugging Face and verl convention: a LambdaLR stepped after each update, the first at lr 0)."""

from __future__ import annotations

import math

import pytest

from trellis.interfaces.optim import lr_factor


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_warmup_ramps_then_follows_the_schedule(schedule):
    factor = lr_factor(4, schedule, 0.1, 12)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    after = [factor(s) for s in (4, 8, 12)]
    assert after == ([1.0, 1.0, 1.0] if schedule == "constant" else pytest.approx([1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)), 0.1]))


def test_warmup_from_zero_starts_at_lr_zero_as_verl():
    factor = lr_factor(4, "constant", 0.0, 12, from_zero=True)
    assert [factor(s) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
