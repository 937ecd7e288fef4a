"""AdamW and the LR schedule (linear warm-up, then constant or cosine) from ``OptimConfig``."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def make_optimizer(params, cfg, total_steps: int) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over ``params`` and its scheduler; ``total_steps`` (trainer steps) shapes the cosine."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    return optimizer, LambdaLR(optimizer, lr_factor(cfg.warmup_steps, cfg.lr_schedule, cfg.min_lr_ratio, total_steps))


def lr_factor(warmup: int, schedule: str, min_ratio: float, total_steps: int):
    """Multiplier of the base LR at scheduler step ``s`` (0-based)."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"actor/critic optim.lr_schedule {schedule!r} is unknown; valid: constant, cosine")

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if schedule == "constant" or total_steps <= warmup:
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
