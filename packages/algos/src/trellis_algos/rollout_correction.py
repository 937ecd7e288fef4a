"""Rollout correction: importance weights and rejection between the rollout engine's log-probs and
the trainer's, for when the two numerics differ (vLLM/SGLang vs the training backend).

Inputs are ``(batch, response_len)``: ``log_prob`` (the trainer's: old log-probs, or the current
ones in bypass mode), ``rollout_log_prob`` (the engine's) and ``response_mask``. The log-ratio is
``log_prob - rollout_log_prob``. Nothing here carries a gradient.

- **IS weights** (``rollout_is``): ``token``: ``w_t = exp(log-ratio_t)``; ``sequence``: one weight
  ``exp(sum_t log-ratio_t)`` per sequence (log clamped to ±20 in both). Then truncated to at most
  ``rollout_is_threshold`` (TIS) or, with ``rollout_is_threshold_lower``, zeroed outside
  ``[lower, threshold]`` (IcePop); optionally divided by their mean over the batch.
- **Rejection** (``rollout_rs``): comma-separated criteria ``{token,seq_sum,seq_mean,seq_max}_k{1,2,3}``
  (no ``seq_max_k1``) on the per-token divergences ``k1 = -x``, ``k2 = x^2 / 2``,
  ``k3 = exp(x) - 1 - x`` of the log-ratio ``x`` (clamped to ±20); a token (or every token of a
  sequence) fails k2/k3 above its threshold, k1 outside ``[log lower, log upper]``. Failing tokens
  leave the mask.
- **Metrics** (prefix ``rollout_corr/``): weight mean/max/min/std, effective sample size, fractions
  above/below the bounds, batch-norm factor, rejected fractions, and the mismatch itself:
  ``kl`` = KL(rollout || trainer) ``E[logp_rollout - logp]``, ``k3_kl``, ``chi2_token``, ``chi2_seq``,
  ``log_ppl_diff``.

Same formulas as verl 0.9.1's ``rollout_corr_helper`` (see ``docs/algorithms.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trellis import choice, ranged
from trellis_algos.stats import masked_count, masked_mean, masked_sum

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")


@dataclass
class RolloutCorrectionOptions:
    """Rollout-correction keys (every policy loss's options carry them).

    rollout_is: None (no weights) | ``token`` | ``sequence``. rollout_is_threshold: upper bound of
    the weights (truncation). rollout_is_threshold_lower: if set, weights outside
    ``[lower, threshold]`` become 0 instead (IcePop). rollout_is_batch_normalize: divide the
    weights by their mean over the batch. rollout_rs: rejection criteria, comma-separated (e.g.
    ``token_k1,seq_mean_k3``); rollout_rs_threshold: one threshold for all or one per criterion,
    comma-separated; k1 takes ``lower_upper`` or ``upper`` (lower = 1 / upper), others an upper
    bound. log_metrics: log the mismatch metrics even with no weights and no rejection.
    """

    rollout_is: str | None = choice(None, IS_LEVELS)
    rollout_is_threshold: float = ranged(2.0, gt=0)
    rollout_is_threshold_lower: float | None = ranged(None, ge=0)
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | None = None
    log_metrics: bool = False

    @property
    def enabled(self) -> bool:
        """Whether anything (weights, rejection or metrics) is asked for."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.log_metrics


def _where(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def raw_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Untruncated weights ``(batch, response_len)``, 0 where masked: per token, or the sequence's
    product of token ratios on each of its tokens."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_correction.rollout_is is {level!r}; valid: {', '.join(IS_LEVELS)} (or null for none)")
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    return _where(mask, torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)))


def is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, options: RolloutCorrectionOptions, batch_mean: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated (or IcePop) weights ``(batch, response_len)``, 0 where masked, and their metrics.

    With ``rollout_is_batch_normalize`` they are divided by ``batch_mean`` (default: their own
    mean here, see :func:`is_batch_mean`) when it is above 1e-8.
    """
    upper, lower = _is_bounds(options)
    weights, raw = truncated_is_weights(log_ratio, mask, options)
    valid = mask.bool()
    metrics = {
        "is_mean": float(masked_mean(weights, valid)),
        "is_max": float(weights.masked_fill(~valid, float("-inf")).max()) if valid.any() else 0.0,
        "is_min": float(weights.masked_fill(~valid, float("inf")).min()) if valid.any() else 0.0,
        "is_std": float(masked_mean((weights - masked_mean(weights, valid)).square(), valid).sqrt()),
        "is_fraction_high": float(masked_mean((raw > upper).to(raw.dtype), valid)),
        "is_fraction_low": float(masked_mean((raw < (lower if lower is not None else 1.0 / upper)).to(raw.dtype), valid)),
    }
    # effective sample size of the normalised weights: 1 / E[(w / E[w])^2]
    second = masked_mean((weights / (masked_mean(weights, valid) + 1e-8)).square(), valid)
    metrics["is_eff_sample_size"] = float(1.0 / second) if second > 0 else 0.0
    if options.rollout_is_batch_normalize:
        mean = batch_mean if batch_mean is not None else is_batch_mean(weights, mask, options.rollout_is)
        factor = float(mean) if mean > 1e-8 else 1.0
        weights = weights / factor
        metrics["is_batch_norm_factor"] = factor
    return weights.detach(), metrics


def truncated_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, options: RolloutCorrectionOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, raw weights)`` ``(batch, response_len)``: truncated at the threshold, or zeroed
    outside ``[lower, threshold]`` (IcePop); not batch-normalised."""
    upper, lower = _is_bounds(options)
    raw = raw_is_weights(log_ratio, mask, options.rollout_is)
    weights = raw.clamp(max=upper) if lower is None else torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    return weights, raw


@torch.no_grad()
def batch_normaliser(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, options: RolloutCorrectionOptions) -> torch.Tensor:
    """The mean weight of a whole batch, to pass as ``batch_mean`` to each of its parts."""
    weights, _ = truncated_is_weights(log_prob - rollout_log_prob, mask, options)
    return is_batch_mean(weights, mask, options.rollout_is)


def is_batch_mean(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The batch normaliser: the mean weight over valid tokens (``token``) or over sequences with
    a valid token (``sequence``, one weight each)."""
    if level == "token":
        return masked_mean(weights, mask)
    seq_valid = masked_count(mask, dim=-1) > 0
    return masked_mean(masked_mean(weights, mask, dim=-1), seq_valid)


def _is_bounds(options: RolloutCorrectionOptions) -> tuple[float, float | None]:
    upper, lower = options.rollout_is_threshold, options.rollout_is_threshold_lower
    if upper <= 0:
        raise ValueError(f"rollout_correction.rollout_is_threshold must be > 0, got {upper}")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"rollout_correction.rollout_is_threshold_lower must be in (0, rollout_is_threshold={upper}], got {lower}")
    return upper, lower


def rs_criteria(rollout_rs: str, rollout_rs_threshold: str | float | None) -> list[tuple[str, str, float | None, float]]:
    """Parse the rejection options: ``[(level, estimator, lower or None, upper)]``; k1 bounds are
    ratios (``lower_upper``, or ``upper`` with lower = 1 / upper), the others upper bounds."""
    names = list(dict.fromkeys(n.strip() for n in rollout_rs.split(",") if n.strip()))
    if rollout_rs_threshold is None:
        raise ValueError("rollout_correction.rollout_rs_threshold must be set when rollout_rs is (e.g. '2.0' or '0.5_2.0,0.01')")
    specs = [s.strip() for s in str(rollout_rs_threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"rollout_correction.rollout_rs_threshold has {len(specs)} entries for {len(names)} rollout_rs criteria; give one or one each"
        )
    parsed = []
    for name, spec in zip(names, specs * len(names) if len(specs) == 1 else specs):
        level, _, estimator = name.rpartition("_")
        if level not in RS_LEVELS or estimator not in ("k1", "k2", "k3") or name == "seq_max_k1":
            valid = [f"{lv}_{k}" for lv in RS_LEVELS for k in ("k1", "k2", "k3") if f"{lv}_{k}" != "seq_max_k1"]
            raise ValueError(f"rollout_correction.rollout_rs has unknown criterion {name!r}; valid: {', '.join(valid)}")
        try:
            bounds = [float(b) for b in spec.split("_")]
        except ValueError:
            raise ValueError(f"rollout_correction.rollout_rs_threshold entry {spec!r} for {name!r} is not a number") from None
        if estimator == "k1":
            lower, upper = bounds if len(bounds) == 2 else (1.0 / bounds[0], bounds[0])
        elif len(bounds) == 1:
            lower, upper = None, bounds[0]
        else:
            raise ValueError(f"rollout_correction.rollout_rs_threshold entry {spec!r} for {name!r} takes one upper bound, without '_'")
        if upper <= 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"rollout_correction.rollout_rs_threshold entry {spec!r} for {name!r}: bounds must be positive and lower <= upper")
        parsed.append((level, estimator, lower, upper))
    return parsed


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, rollout_rs: str, rollout_rs_threshold: str | float | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """The mask ``(batch, response_len)`` bool with the rejected tokens removed, and metrics
    ``rs_masked_fraction`` (rejected valid tokens) and ``rs_seq_masked_fraction`` (rows that lost
    a token, over all rows)."""
    x = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -x, "k2": 0.5 * x.square(), "k3": torch.exp(x) - 1.0 - x}
    valid = mask.bool()
    keep = torch.ones_like(valid)
    for level, estimator, lower, upper in rs_criteria(rollout_rs, rollout_rs_threshold):
        stat = per_token[estimator]
        if level == "seq_sum":
            stat = masked_sum(stat, valid, dim=-1).unsqueeze(-1)
        elif level == "seq_mean":
            stat = masked_mean(stat, valid, dim=-1).unsqueeze(-1)
        elif level == "seq_max":
            top = stat.masked_fill(~valid, float("-inf")).max(dim=-1).values
            stat = torch.where(torch.isinf(top), torch.zeros_like(top), top).unsqueeze(-1)
        passed = (stat >= math.log(lower)) & (stat <= math.log(upper)) if lower is not None else stat <= upper
        keep = keep & passed.expand_as(valid)
    kept = valid & keep
    rejected = valid & ~keep
    return kept, {
        "rs_masked_fraction": float(masked_mean(rejected.to(log_ratio.dtype), valid)),
        "rs_seq_masked_fraction": float(rejected.any(-1).to(log_ratio.dtype).mean()) if len(valid) else 0.0,
    }


def mismatch_metrics(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer is from the engine: ``kl`` (KL(rollout || trainer), k1), ``abs_diff``
    (mean |trainer - rollout| log-prob per token: what core's agreement check bounds), ``k3_kl``,
    ``chi2_token`` ``E[w^2] - 1``, ``chi2_seq`` ``E_seq[(prod w)^2] - 1`` (log clamped to ±20) and
    ``log_ppl_diff`` (mean over sequences of the rollout's mean log-prob minus the trainer's)."""
    x = log_prob - rollout_log_prob
    seq_valid = masked_count(mask, dim=-1) > 0
    seq_sum = torch.clamp(masked_sum(x, mask, dim=-1), -SAFETY_BOUND, SAFETY_BOUND)
    ppl_diff = masked_mean(rollout_log_prob, mask, dim=-1) - masked_mean(log_prob, mask, dim=-1)
    return {
        "kl": float(masked_mean(-x, mask)),
        "abs_diff": float(masked_mean(x.abs(), mask)),
        "k3_kl": float(masked_mean(torch.exp(x) - x - 1.0, mask)),
        "chi2_token": float(masked_mean(torch.exp(2.0 * torch.clamp(x, -SAFETY_BOUND, SAFETY_BOUND)), mask) - 1.0),
        "chi2_seq": float(masked_mean(torch.exp(2.0 * seq_sum), seq_valid) - 1.0),
        "log_ppl_diff": float(masked_mean(ppl_diff, seq_valid)),
    }


@torch.no_grad()
def rollout_correction(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    options: RolloutCorrectionOptions,
    batch_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """IS weights (None without ``rollout_is``), the mask after rejection (same dtype as
    ``response_mask``) and the metrics, prefixed ``rollout_corr/``. ``batch_mean``: the
    normaliser for ``rollout_is_batch_normalize`` when the batch is larger than this call's."""
    if log_prob.shape != rollout_log_prob.shape or log_prob.shape != response_mask.shape:
        raise ValueError(
            f"rollout correction: log_prob {tuple(log_prob.shape)}, rollout_log_prob {tuple(rollout_log_prob.shape)} "
            f"and response_mask {tuple(response_mask.shape)} must have the same shape"
        )
    log_ratio = (log_prob - rollout_log_prob).detach()
    metrics = mismatch_metrics(log_prob.detach(), rollout_log_prob, response_mask)
    weights = None
    if options.rollout_is is not None:
        weights, is_metrics = is_weights(log_ratio, response_mask, options, batch_mean)
        metrics.update(is_metrics)
    mask = response_mask
    if options.rollout_rs is not None:
        kept, rs_metrics = rejection_mask(log_ratio, response_mask, options.rollout_rs, options.rollout_rs_threshold)
        mask = kept.to(response_mask.dtype)
        metrics.update(rs_metrics)
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
