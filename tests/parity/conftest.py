"""Fixtures of the parity tests: seeded cases from ``parity_inputs``."""

from __future__ import annotations

import pytest
from parity_inputs import Case, make_case


@pytest.fixture(params=[0, 1, 2], ids=lambda s: f"seed{s}")
def case(request) -> Case:
    return make_case(request.param)


@pytest.fixture(params=[(0, False), (1, False), (2, True), (3, True)], ids=lambda p: f"seed{p[0]}{'-extreme' if p[1] else ''}")
def loss_case(request) -> Case:
    """Loss inputs, half of them with log-ratios beyond the ±20 clamp."""
    seed, extreme = request.param
    return make_case(seed, extreme=extreme)
