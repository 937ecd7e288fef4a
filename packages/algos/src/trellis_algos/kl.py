"""KL estimators (kind ``kl``) and the fixed/adaptive KL controller for the in-reward KL penalty.

An estimator is ``fn(log_prob, ref_log_prob) -> (batch, response_len)`` per-token estimate of
KL(pi || pi_ref) from samples of pi, with ``delta = logp - logp_ref`` (Schulman, "Approximating
KL divergence", 2020): ``k1 = delta``, ``abs = |delta|``, ``k2 = delta^2 / 2``,
``k3 = exp(-delta) + delta - 1`` (``low_var_kl``; input clamped to ±20, output to ±10, as verl).
Every name has a straight-through ``+`` variant (``k1+``, ``abs+``, ``k3+``, ...): the value of the
estimator with the gradient of k2, whose expected gradient is the true KL gradient (``k2+`` is k2).
``kl``, ``mse`` and ``low_var_kl`` are verl's aliases of k1, k2 and k3.

Use in the reward: :func:`apply_kl_penalty` with a controller from :func:`make_kl_controller`.
Use as a loss term: :func:`kl_loss`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trellis import Aggregation, ranged
from trellis_algos.aggregation import agg_loss
from trellis_algos.stats import masked_mean

KLEstimatorFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``delta`` (unbiased, high variance, can be negative)."""
    return log_prob - ref_log_prob


def abs_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``|delta|``."""
    return (log_prob - ref_log_prob).abs()


def k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``delta^2 / 2`` (biased, low variance, non-negative)."""
    return 0.5 * (log_prob - ref_log_prob).square()


def k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``exp(-delta) + delta - 1`` (unbiased, low variance, non-negative); ``-delta`` clamped to
    ±20 and the result to [-10, 10] for stability, as verl's ``low_var_kl``."""
    neg = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(neg) - neg - 1.0, min=-10.0, max=10.0)


def straight_through(estimator: KLEstimatorFn) -> KLEstimatorFn:
    """The ``+`` variant of ``estimator``: its value, with the gradient of k2 (whose expected
    gradient is the true KL gradient). ``k2+`` is k2 itself."""

    def plus(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
        grad_source = k2(log_prob, ref_log_prob)
        return grad_source - grad_source.detach() + estimator(log_prob, ref_log_prob).detach()

    plus.__doc__ = f"Value of {estimator.__name__}, gradient of k2."
    return plus


_BASE: dict[str, KLEstimatorFn] = {"k1": k1, "kl": k1, "abs": abs_kl, "k2": k2, "mse": k2, "k3": k3, "low_var_kl": k3}

# name -> estimator; plugin.py registers these (none has options). Every name also has its
# straight-through ``name+`` (as verl, which strips the ``+`` and keeps k2 as it is).
ESTIMATORS: dict[str, KLEstimatorFn] = {
    **_BASE,
    **{f"{name}+": fn if fn is k2 else straight_through(fn) for name, fn in _BASE.items()},
}


def get_estimator(estimator: str | KLEstimatorFn) -> KLEstimatorFn:
    """An estimator by name (one of :data:`ESTIMATORS`) or the callable itself."""
    if callable(estimator):
        return estimator
    try:
        return ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}") from None


# -- controllers --------------------------------------------------------------------------------
@dataclass
class KLControlOptions:
    """type: ``fixed`` or ``adaptive``; kl_coef: the (initial) coefficient; target_kl and
    horizon: the adaptive controller's target and horizon (verl's defaults)."""

    type: str = "fixed"
    kl_coef: float = ranged(0.001, ge=0)
    target_kl: float = ranged(0.1, gt=0)
    horizon: int = ranged(10000, ge=1)


class FixedKLController:
    """A constant coefficient ``value``."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No change."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. (arXiv:1909.08593): after each batch of ``n_steps`` samples,
    ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int) -> None:
        super().__init__(kl_coef)
        if horizon <= 0:
            raise ValueError(f"adaptive KL controller: horizon must be > 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"adaptive KL controller: target_kl must be > 0, got {target_kl}")
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}


def make_kl_controller(options: KLControlOptions | Any | None = None) -> FixedKLController:
    """The controller named by ``options.type``."""
    opts = options if options is not None else KLControlOptions()
    if opts.type == "fixed":
        return FixedKLController(opts.kl_coef)
    if opts.type == "adaptive":
        return AdaptiveKLController(opts.kl_coef, opts.target_kl, opts.horizon)
    raise ValueError(f"unknown KL controller type {opts.type!r}; valid: fixed, adaptive")


def apply_kl_penalty(
    token_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    controller: FixedKLController,
    estimator: str | KLEstimatorFn = "k1",
    update: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """In-reward KL (as verl's ``apply_kl_penalty``): ``token_rewards = scores - beta * kl * mask``
    with ``beta = controller.value``; ``current_kl`` = mean over sequences of the per-sequence
    mean KL over valid tokens. Then, when ``update``, ``controller.update(current_kl, batch)``.
    Metrics: ``kl`` (current_kl) and ``kl_coef`` (the beta used)."""
    with torch.no_grad():
        kld = get_estimator(estimator)(log_prob, ref_log_prob)
        kld = torch.where(response_mask.bool(), kld, torch.zeros_like(kld))
        beta = controller.value
        rewards = token_scores - beta * kld
        current_kl = float(masked_mean(kld, response_mask, dim=-1).mean().item())
    if update:
        controller.update(current_kl, n_steps=token_scores.shape[0])
    return rewards, {"kl": current_kl, "kl_coef": beta}


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    agg: Aggregation,
    estimator: str | KLEstimatorFn = "low_var_kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL as a loss term (GRPO-style ``use_kl_loss``): the per-token estimate aggregated like the
    policy loss. The caller multiplies by its coefficient. Metric: ``kl_loss``."""
    loss = agg_loss(get_estimator(estimator)(log_prob, ref_log_prob), response_mask, agg)
    return loss, {"kl_loss": float(loss.item())}
