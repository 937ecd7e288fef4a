"""Seeded random inputs for the parity tests against verl 0.9.1 (``nox -s parity`` installs it):
masks with holes, a fully masked row, a singleton group, a group of identical scores and
extreme log-ratios. Everything is float64 so that 1e-5 measures the formulas, not rounding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOL = {"atol": 1e-5, "rtol": 1e-5}
B, T = 12, 7
# samples per prompt: groups 0 and 1 of three, 2 a singleton, 3 three identical scores, 4 a pair
GROUPS = [0, 0, 0, 1, 1, 1, 2, 3, 3, 3, 4, 4]
EMPTY_ROW = 4  # fully masked (in group 1)
EXTREME = [(0, 1, 25.0), (7, 0, -26.0), (11, 2, 23.0)]  # (row, col, log-ratio) on valid tokens


@dataclass
class Case:
    """mask (B, T) long; rewards (B, T) with the score on the last valid token; log_prob (leaf
    with gradient), old_log_prob, rollout_log_prob, advantages, values, returns (B, T); group_ids
    (B,); baselines (B,). ``extreme``: whether some log-ratios are beyond ±20."""

    mask: torch.Tensor
    rewards: torch.Tensor
    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    rollout_log_prob: torch.Tensor
    advantages: torch.Tensor
    values: torch.Tensor
    returns: torch.Tensor
    group_ids: torch.Tensor
    baselines: torch.Tensor
    extreme: bool

    def fresh_log_prob(self) -> torch.Tensor:
        """A new leaf with the same values (one per side of a gradient comparison)."""
        return self.log_prob.detach().clone().requires_grad_(True)


def make_case(seed: int, extreme: bool = False, empty_row: bool = True) -> Case:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).long()
    holes = (torch.rand(B, T, generator=g) < 0.2) & (torch.arange(T) > 0) & (torch.arange(T) < lengths[:, None] - 1)
    mask[holes] = 0  # environment tokens inside multi-turn responses
    if empty_row:
        mask[EMPTY_ROW] = 0
    scores = torch.randint(0, 3, (B,), generator=g).double()
    scores[[7, 8, 9]] = 1.0  # identical scores in group 3
    rewards = torch.zeros(B, T, dtype=torch.float64)
    last = torch.where(mask.bool(), torch.arange(T), torch.full((B, T), -1)).max(-1).values
    rows = last >= 0
    rewards[rows.nonzero(as_tuple=True)[0], last[rows]] = scores[rows]
    old = -3.0 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.05
    log_ratio = 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    if extreme:
        for r, c, x in EXTREME:
            mask[r, c] = 1
            log_ratio[r, c] = x
    log_prob = (old + log_ratio).requires_grad_(True)
    rollout = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return Case(
        mask=mask,
        rewards=rewards,
        log_prob=log_prob,
        old_log_prob=old,
        rollout_log_prob=rollout,
        advantages=torch.randn(B, T, generator=g, dtype=torch.float64),
        values=torch.randn(B, T, generator=g, dtype=torch.float64),
        returns=torch.randn(B, T, generator=g, dtype=torch.float64),
        group_ids=torch.tensor(GROUPS),
        baselines=torch.randn(B, generator=g, dtype=torch.float64),
        extreme=extreme,
    )
