"""The optimizer every backend builds from a role's ``OptimConfig`` (AdamW, linear warm-up then a
constant or cosine LR schedule) and the clipped, non-finite-safe optimizer step."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def make_optimizer(params, cfg, total_steps: int, implementation: str = "auto") -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over ``params`` and its scheduler; ``total_steps`` (trainer steps) shapes the cosine.

    ``implementation``: ``auto`` (fused kernels on CUDA, the multi-tensor ``foreach`` path
    elsewhere: one kernel per step and parameter group instead of one per tensor), or ``fused``,
    ``foreach``, ``per_tensor`` (torch's loop over tensors). All compute the same update."""
    params = list(params)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"optimizer implementation {implementation!r} is unknown; valid: {', '.join(IMPLEMENTATIONS)}")
    if implementation == "auto":
        implementation = "fused" if params and all(p.device.type == "cuda" for p in params) else "foreach"
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "per_tensor": {"foreach": False}}[implementation]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, **flags)
    return optimizer, LambdaLR(optimizer, lr_factor(cfg.warmup_steps, cfg.lr_schedule, cfg.min_lr_ratio, total_steps, cfg.warmup_from_zero))


IMPLEMENTATIONS = ("auto", "fused", "foreach", "per_tensor")


LR_SCHEDULES = ("constant", "cosine")


def lr_factor(warmup: int, schedule: str, min_ratio: float, total_steps: int, from_zero: bool = False):
    """Multiplier of the base LR at scheduler step ``s`` (0-based); warm-up at ``(s + 1) / warmup``,
    or ``s / warmup`` ``from_zero``."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"LR schedule {schedule!r} is unknown; valid: {', '.join(LR_SCHEDULES)}")

    def factor(s: int) -> float:
        if s < warmup:
            return (s + (not from_zero)) / warmup
        if schedule == "constant" or total_steps <= warmup:
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def schedule_step(scheduler: LambdaLR) -> float:
    """Advance the LR schedule by one trainer step; returns the LR that was in use."""
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    return lr


def clipped_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, grad_clip: float) -> dict[str, float]:
    """Clip the gradients of ``params`` to a global norm of ``grad_clip`` (0: no clipping), step
    unless the norm is not finite (a non-finite gradient would poison the weights), zero them.
    Returns ``grad_norm`` and ``skipped_steps`` (1.0 when the step was skipped)."""
    # clip_grad_norm_ skips parameters without a gradient; foreach: one norm kernel for all tensors
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"), foreach=_foreach(params))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a sharded (DTensor) norm
    skipped = 0.0 if torch.isfinite(norm) else 1.0
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(norm), "skipped_steps": skipped}


def _foreach(params: list[torch.nn.Parameter]) -> bool | None:
    """True where every parameter's device has multi-tensor kernels (CPU and CUDA do); None lets
    torch choose."""
    return True if params and all(p.device.type in ("cpu", "cuda") for p in params) else None
