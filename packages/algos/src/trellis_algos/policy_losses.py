"""Policy losses (kind ``policy_loss``): vanilla (PPO), clip_cov, kl_cov, gspo, cispo, gmpo/geo_mean, reinforce.

Each is ``fn(data: PolicyLossInputs, agg: Aggregation, options) -> (loss, metrics)``. The token
ratio is ``r = exp(clamp(logp - logp_old, -20, 20))``. Metrics are plain floats named ``pg_loss``
(this call's loss: a micro-batch's share when ``agg`` carries global counts), ``clip_frac``
(fraction of valid tokens whose ratio was clipped), ``clip_frac_lower`` (dual clip),
``approx_kl`` (mean of ``logp_old - logp`` over valid tokens, verl's ``ppo_kl``) and per-loss
extras. The actor adds the ``actor/`` prefix. ``options=None`` means the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trellis.interfaces.signatures import Aggregation, PolicyLossInputs
from trellis_algos.aggregation import agg_loss, seq_mean
from trellis_algos.stats import masked_count, masked_mean, masked_sum

LOG_RATIO_CLAMP = 20.0


@dataclass
class VanillaOptions:
    """PPO clip range ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` (clip-higher when high > low);
    dual clip bound ``clip_ratio_c`` (> 1) for negative advantages."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0


@dataclass
class ClipCovOptions:
    """PPO clip range; ``clip_cov_ratio``: fraction of valid tokens detached; detached tokens are
    drawn among those with ``clip_cov_lb < cov < clip_cov_ub``."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0


@dataclass
class KLCovOptions:
    """``kl_cov_ratio``: fraction of valid tokens (highest covariance) penalised by
    ``ppo_kl_coef * |log r|``."""

    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 1.0


@dataclass
class GSPOOptions:
    """Clip range of the *sequence* ratio; the defaults are the GSPO paper's (3e-4, 4e-4):
    sequence ratios are geometric means and stay close to 1, so PPO's 0.2 would never clip."""

    clip_ratio_low: float = 3e-4
    clip_ratio_high: float = 4e-4


@dataclass
class CISPOOptions:
    """Clip range of the (stop-gradient) importance weight. MiniMax-M1 effectively drops the
    lower bound (a large ``clip_ratio_low``) and tunes only ``clip_ratio_high``."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2


@dataclass
class GMPOOptions:
    """Token-level clip range in *log* space, ``log r`` in ``[-clip_ratio_low, clip_ratio_high]``;
    the defaults are the GMPO paper's (e^-0.4, e^0.4)."""

    clip_ratio_low: float = 0.4
    clip_ratio_high: float = 0.4


def _log_ratio(data: PolicyLossInputs) -> torch.Tensor:
    return torch.clamp(data.log_prob - data.old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _frac(flags: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(flags.to(torch.float32), mask).item())


def _approx_kl(log_ratio: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(-log_ratio.detach(), mask).item())


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``max(-A r, -A clip(r, 1 - low, 1 + high))`` and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _covariance(data: PolicyLossInputs) -> torch.Tensor:
    """``(A - mean A)(logp - mean logp)`` over valid tokens (detached; means over this call)."""
    adv, logp, mask = data.advantages.detach(), data.log_prob.detach(), data.response_mask
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))


def vanilla(
    data: PolicyLossInputs, agg: Aggregation, options: VanillaOptions | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with clip-higher and dual clip (as verl's ``vanilla``).

    ``L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; for ``A < 0`` additionally
    ``L = min(L, -A c)`` (dual-clip PPO), so a huge ratio on a bad token cannot blow the loss up.
    """
    opts = options if options is not None else VanillaOptions()
    if opts.clip_ratio_c <= 1.0:
        raise ValueError(f"vanilla: clip_ratio_c (dual-clip bound) must be > 1, got {opts.clip_ratio_c}")
    mask, adv = data.response_mask, data.advantages
    log_ratio = _log_ratio(data)
    losses, clipped = _clipped_surrogate(torch.exp(log_ratio), adv, opts.clip_ratio_low, opts.clip_ratio_high)
    dual_bound = -adv * opts.clip_ratio_c
    dual_clipped = (losses > dual_bound) & (adv < 0)
    losses = torch.where(adv < 0, torch.minimum(losses, dual_bound), losses)
    loss = agg_loss(losses, mask, agg)
    return loss, {
        "pg_loss": float(loss.item()),
        "clip_frac": _frac(clipped, mask),
        "clip_frac_lower": _frac(dual_clipped, mask),
        "approx_kl": _approx_kl(log_ratio, mask),
    }


def clip_cov_selection(
    data: PolicyLossInputs, options: ClipCovOptions | None = None, clipped: torch.Tensor | None = None
) -> torch.Tensor:
    """Bool ``(batch, response_len)``: the tokens Clip-Cov detaches.

    Candidates are valid tokens not already clipped by the PPO range with
    ``clip_cov_lb < cov < clip_cov_ub``; ``k = max(1, int(clip_cov_ratio * valid tokens))`` of them
    (all if fewer) are drawn uniformly with ``torch.randperm`` on the **global CPU torch RNG**, so
    ``torch.manual_seed`` makes the choice reproducible (verl draws the same way). ``clipped``: the
    PPO-range clip flags when the caller has them already (else computed here).
    """
    opts = options if options is not None else ClipCovOptions()
    if opts.clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov: clip_cov_ratio must be > 0, got {opts.clip_cov_ratio}")
    valid = data.response_mask.bool()
    with torch.no_grad():
        if clipped is None:
            _, clipped = _clipped_surrogate(
                torch.exp(_log_ratio(data)), data.advantages, opts.clip_ratio_low, opts.clip_ratio_high
            )
        cov = _covariance(data)
        candidates = valid & ~clipped & (cov > opts.clip_cov_lb) & (cov < opts.clip_cov_ub)
        k = max(1, int(opts.clip_cov_ratio * int(valid.sum().item())))
        flat = torch.nonzero(candidates.reshape(-1), as_tuple=True)[0]
        chosen = flat[torch.randperm(flat.numel())[:k].to(flat.device)]
        selected = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
        selected[chosen] = True
    return selected.reshape(candidates.shape)


def clip_cov(
    data: PolicyLossInputs, agg: Aggregation, options: ClipCovOptions | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov: PPO clipped surrogate, with the tokens of :func:`clip_cov_selection` detached
    (their loss term is 0, so they get no gradient; they still count in the normaliser).

    The other tokens take ``max(-A r, -A clip(r))`` without dual clip, as verl and the paper.
    Unlike verl, the ratio uses the common ±20 log-ratio clamp, and ``clip_frac`` keeps its usual
    meaning (PPO-range clipping); the detached fraction is ``clip_cov_frac`` (verl reports it as
    ``pg_clipfrac``). The selection is per call, so it depends on the micro-batching (as verl).
    """
    opts = options if options is not None else ClipCovOptions()
    mask = data.response_mask
    log_ratio = _log_ratio(data)
    losses, clipped = _clipped_surrogate(
        torch.exp(log_ratio), data.advantages, opts.clip_ratio_low, opts.clip_ratio_high
    )
    selected = clip_cov_selection(data, opts, clipped)
    losses = torch.where(selected, torch.zeros_like(losses), losses)
    loss = agg_loss(losses, mask, agg)
    return loss, {
        "pg_loss": float(loss.item()),
        "clip_frac": _frac(clipped, mask),
        "clip_cov_frac": _frac(selected, mask),
        "approx_kl": _approx_kl(log_ratio, mask),
    }


def kl_cov_selection(data: PolicyLossInputs, options: KLCovOptions | None = None) -> torch.Tensor:
    """Bool ``(batch, response_len)``: the ``k = max(1, int(kl_cov_ratio * valid tokens))`` valid
    tokens with the largest covariance (at most all valid tokens, none when nothing is valid);
    ties broken by ``topk``."""
    opts = options if options is not None else KLCovOptions()
    if opts.kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov: kl_cov_ratio must be > 0, got {opts.kl_cov_ratio}")
    valid = data.response_mask.bool()
    with torch.no_grad():
        n_valid = int(valid.sum().item())
        selected = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        if n_valid:
            k = min(n_valid, max(1, int(opts.kl_cov_ratio * n_valid)))
            flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
            cov = _covariance(data).reshape(-1)[flat_valid]
            selected[flat_valid[torch.topk(cov, k).indices]] = True
    return selected.reshape(valid.shape)


def kl_cov(
    data: PolicyLossInputs, agg: Aggregation, options: KLCovOptions | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov: ``-A r`` on every token (no clipping), plus ``ppo_kl_coef * |log r|`` on the
    top-k covariance tokens of :func:`kl_cov_selection` (as verl; the penalty uses the clamped
    log-ratio). Extra metrics: ``abs_kl`` (verl's ``ppo_kl`` for this loss), ``kl_cov_frac``."""
    opts = options if options is not None else KLCovOptions()
    mask, adv = data.response_mask, data.advantages
    log_ratio = _log_ratio(data)
    losses = -adv * torch.exp(log_ratio)
    selected = kl_cov_selection(data, opts)
    losses = torch.where(selected, losses + opts.ppo_kl_coef * log_ratio.abs(), losses)
    loss = agg_loss(losses, mask, agg)
    return loss, {
        "pg_loss": float(loss.item()),
        "kl_cov_frac": _frac(selected, mask),
        "abs_kl": float(masked_mean(log_ratio.detach().abs(), mask).item()),
        "approx_kl": _approx_kl(log_ratio, mask),
    }


def gspo(
    data: PolicyLossInputs, agg: Aggregation, options: GSPOOptions | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: sequence-level ratio ``s = exp(mean_t log r_t)`` over valid tokens, used per token as
    ``s_t = sg(s) * pi_t / sg(pi_t)`` (log clamped at 10), loss ``max(-A s_t, -A clip(s_t))``.

    Always aggregated with ``seq-mean-token-mean`` (keeping ``agg.global_seqs``), whatever
    ``agg.mode`` says: the sequence ratio is only meaningful per sequence (as verl).
    """
    opts = options if options is not None else GSPOOptions()
    mask, logp = data.response_mask, data.log_prob
    log_ratio = _log_ratio(data)
    lengths = masked_count(mask, dim=-1).to(log_ratio.dtype).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / lengths
    log_s = torch.clamp(logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    losses, clipped = _clipped_surrogate(torch.exp(log_s), data.advantages, opts.clip_ratio_low, opts.clip_ratio_high)
    forced = Aggregation(mode="seq-mean-token-mean", global_seqs=agg.global_seqs)
    loss = agg_loss(losses, mask, forced)
    return loss, {
        "pg_loss": float(loss.item()),
        "clip_frac": _frac(clipped, mask),
        "approx_kl": _approx_kl(log_ratio, mask),
    }


def cispo(
    data: PolicyLossInputs, agg: Aggregation, options: CISPOOptions | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: ``L = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp``: the importance weight
    is clipped and detached, so every token keeps a gradient ``-w A grad(logp)``."""
    opts = options if options is not None else CISPOOptions()
    mask = data.response_mask
    log_ratio = _log_ratio(data)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - opts.clip_ratio_low, 1.0 + opts.clip_ratio_high).detach()
    losses = -weight * data.advantages * data.log_prob
    loss = agg_loss(losses, mask, agg)
    return loss, {
        "pg_loss": float(loss.item()),
        "clip_frac": _frac(ratio.detach() != weight, mask),
        "approx_kl": _approx_kl(log_ratio, mask),
    }


def gmpo(
    data: PolicyLossInputs, agg: Aggregation, options: GMPOOptions | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (verl's ``geo_mean``): geometric-mean ratio per sequence.

    Token log-ratios are clipped to ``[-eps_low, eps_high]`` on the pessimistic side only
    (``sgn(A) * min(sgn(A) x, sgn(A) clip(x))``), averaged over valid tokens and exponentiated:
    ``rho = exp(mean_t clipped log r_t)``; with the sequence advantage ``A = mean_t A_t``, the
    sequence loss is ``-A rho``. Sequence losses are always averaged over sequences (``agg.mode`` is
    ignored, as verl), but by ``agg.global_seqs``: verl takes a plain mean per micro-batch, which
    changes the loss when a mini-batch is split, a bug fixed here. Sequences with no valid token
    do not count. ``clip_frac``/``clip_frac_lower``: clipped tokens with ``A > 0`` / ``A < 0``.
    """
    opts = options if options is not None else GMPOOptions()
    mask, adv = data.response_mask, data.advantages
    log_ratio = _log_ratio(data)
    sign = torch.sign(adv)
    bounded = torch.clamp(log_ratio, -opts.clip_ratio_low, opts.clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    seq_tokens = masked_count(mask, dim=-1)
    lengths = seq_tokens.to(log_ratio.dtype).clamp(min=1)
    seq_ratio = torch.exp(masked_sum(pessimistic, mask, dim=-1) / lengths)
    seq_adv = masked_sum(adv, mask, dim=-1) / lengths
    loss = seq_mean(-seq_adv * seq_ratio, seq_tokens > 0, agg.global_seqs)
    clipped = log_ratio != bounded
    return loss, {
        "pg_loss": float(loss.item()),
        "clip_frac": _frac(clipped & (adv > 0), mask),
        "clip_frac_lower": _frac(clipped & (adv < 0), mask),
        "approx_kl": _approx_kl(log_ratio, mask),
    }


def reinforce(data: PolicyLossInputs, agg: Aggregation, options: None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE: ``L = -A logp`` (no ratio, no clipping). ``approx_kl`` is measured against
    ``rollout_log_prob`` when given (the policy that sampled), else against ``old_log_prob``.
    Also registered as ``gpg`` (verl's ``loss_mode: gpg`` is this same loss)."""
    mask = data.response_mask
    losses = -data.advantages * data.log_prob
    loss = agg_loss(losses, mask, agg)
    behaviour = data.rollout_log_prob if data.rollout_log_prob is not None else data.old_log_prob
    return loss, {
        "pg_loss": float(loss.item()),
        "approx_kl": float(masked_mean((behaviour - data.log_prob).detach(), mask).item()),
    }


# name -> (loss, options dataclass or None); plugin.py registers these.
LOSSES = {
    "vanilla": (vanilla, VanillaOptions),
    "clip_cov": (clip_cov, ClipCovOptions),
    "kl_cov": (kl_cov, KLCovOptions),
    "gspo": (gspo, GSPOOptions),
    "cispo": (cispo, CISPOOptions),
    "gmpo": (gmpo, GMPOOptions),
    "geo_mean": (gmpo, GMPOOptions),
    "reinforce": (reinforce, None),
    "gpg": (reinforce, None),
}
