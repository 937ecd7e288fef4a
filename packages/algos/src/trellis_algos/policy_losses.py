"""Policy losses (kind ``policy_loss``): vanilla (PPO), clip_cov, kl_cov, gspo, sapo, cispo, gmpo/geo_mean,
dppo_tv, dppo_kl, dro, reinforce/gpg and bypass_mode.

Each is ``fn(data: PolicyLossInputs, agg: Aggregation, options) -> (loss, metrics)``. The token
ratio is ``r = exp(clamp(logp - logp_old, -20, 20))``. When ``data.rollout_is_weights`` is set
(rollout correction, see :mod:`trellis_algos.rollout_correction`) each loss multiplies its
per-token loss by those weights before aggregating (gmpo: by their per-sequence geometric mean).
Metrics are plain floats named ``pg_loss`` (this call's loss: a micro-batch's share when ``agg``
carries global counts), ``clip_frac`` (fraction of valid tokens whose ratio was clipped),
``clip_frac_lower`` (dual clip), ``approx_kl`` (mean of ``logp_old - logp`` over valid tokens,
verl's ``ppo_kl``) and per-loss extras. The actor adds the ``actor/`` prefix.
``options=None`` means the defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from trellis import Aggregation, PolicyLossInputs, choice, ranged
from trellis_algos.aggregation import agg_loss, seq_mean
from trellis_algos.rollout_correction import RolloutCorrectionOptions, rollout_correction
from trellis_algos.stats import masked_count, masked_mean, masked_sum

LOG_RATIO_CLAMP = 20.0
BYPASS_LOSSES = ("ppo_clip", "reinforce")


@dataclass
class PolicyLossOptions(RolloutCorrectionOptions):
    """What every policy loss takes: the rollout-correction keys (``rollout_is``,
    ``rollout_rs``, ...; off by default), IS weights and rejection between the rollout engine's
    and the trainer's log-probs that the ``policy`` objective applies."""


@dataclass
class ClipOptions(PolicyLossOptions):
    """Clip range ``[1 - clip_ratio_low, 1 + clip_ratio_high]``; a bound left null takes the
    symmetric ``clip_ratio`` (as verl)."""

    clip_ratio: float | None = ranged(0.2, ge=0)
    clip_ratio_low: float | None = ranged(None, ge=0)
    clip_ratio_high: float | None = ranged(None, ge=0)


@dataclass
class VanillaOptions(ClipOptions):
    """PPO clip range (clip-higher when high > low); dual clip bound ``clip_ratio_c`` (> 1) for
    negative advantages."""

    clip_ratio_c: float = ranged(3.0, gt=1)


@dataclass
class ClipCovOptions(ClipOptions):
    """PPO clip range; ``clip_cov_ratio``: fraction of valid tokens detached; detached tokens are
    drawn among those with ``clip_cov_lb < cov < clip_cov_ub``."""

    clip_cov_ratio: float = ranged(2e-4, gt=0, le=1)
    clip_cov_lb: float = ranged(1.0, ge=0)
    clip_cov_ub: float = ranged(5.0, ge=0)


@dataclass
class KLCovOptions(PolicyLossOptions):
    """``kl_cov_ratio``: fraction of valid tokens (highest covariance) penalised by
    ``ppo_kl_coef * |log r|`` (0.1: verl's ``PolicyLossConfig`` default)."""

    kl_cov_ratio: float = ranged(2e-4, gt=0, le=1)
    ppo_kl_coef: float = ranged(0.1, ge=0)


@dataclass
class GSPOOptions(ClipOptions):
    """Clip range of the *sequence* ratio; the defaults are the GSPO paper's (3e-4, 4e-4):
    sequence ratios are geometric means and stay close to 1, so PPO's 0.2 would never clip.
    Set both bounds to null to use ``clip_ratio``."""

    clip_ratio: float | None = ranged(None, ge=0)
    clip_ratio_low: float | None = ranged(3e-4, ge=0)
    clip_ratio_high: float | None = ranged(4e-4, ge=0)


@dataclass
class CISPOOptions(ClipOptions):
    """Clip range of the (stop-gradient) importance weight. MiniMax-M1 effectively drops the
    lower bound (a large ``clip_ratio_low``) and tunes only ``clip_ratio_high``."""


@dataclass
class GMPOOptions(ClipOptions):
    """Token-level clip range in *log* space, ``log r`` in ``[-clip_ratio_low, clip_ratio_high]``;
    the default is the GMPO paper's (e^-0.4, e^0.4)."""

    clip_ratio: float | None = ranged(0.4, ge=0)


@dataclass
class SAPOOptions(PolicyLossOptions):
    """Gate temperatures: ``tau_pos`` for tokens with ``A > 0``, ``tau_neg`` otherwise (verl's
    defaults; the paper takes ``tau_neg > tau_pos``)."""

    tau_pos: float = ranged(1.0, gt=0)
    tau_neg: float = ranged(1.05, gt=0)


@dataclass
class DPPOOptions(ClipOptions):
    """Divergence thresholds: ``clip_ratio_high`` for ``A > 0`` tokens, ``clip_ratio_low`` for the
    others (total variation ``|p - p_old|`` for ``dppo_tv``, binary KL for ``dppo_kl``);
    ``clip_ratio_c``: truncation of the (detached) importance ratio."""

    clip_ratio_c: float = ranged(20.0, gt=0)


@dataclass
class DROOptions(PolicyLossOptions):
    """``dro_beta`` (> 0, required): weight of the quadratic log-ratio penalty."""

    dro_beta: float | None = ranged(None, gt=0)


@dataclass
class ReinforceOptions(PolicyLossOptions):
    """No options beyond rollout correction."""


@dataclass
class BypassOptions(VanillaOptions):
    """``loss_type``: ``ppo_clip`` (PPO against the rollout's log-probs; the ratio is the IS
    correction, so no weights are applied) or ``reinforce`` (``-w A logp`` with the weights of
    the ``rollout_is`` keys); the ``rollout_rs`` keys reject tokens in both."""

    loss_type: str = choice("ppo_clip", BYPASS_LOSSES)


def clip_range(options: ClipOptions, loss: str) -> tuple[float, float]:
    """``(clip_ratio_low, clip_ratio_high)``, each falling back to ``clip_ratio``."""
    low = options.clip_ratio_low if options.clip_ratio_low is not None else options.clip_ratio
    high = options.clip_ratio_high if options.clip_ratio_high is not None else options.clip_ratio
    if low is None or high is None:
        raise ValueError(f"{loss}: set clip_ratio, or both clip_ratio_low and clip_ratio_high (got clip_ratio=None)")
    return low, high


def _weighted(losses: torch.Tensor, data: PolicyLossInputs) -> torch.Tensor:
    """Per-token losses times the rollout-correction weights, when there are any."""
    return losses if data.rollout_is_weights is None else losses * data.rollout_is_weights


def _log_ratio(data: PolicyLossInputs) -> torch.Tensor:
    return torch.clamp(data.log_prob - data.old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _frac(flags: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(flags.to(torch.float32), mask).item())


def _approx_kl(log_ratio: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(-log_ratio.detach(), mask).item())


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``max(-A r, -A clip(r, 1 - low, 1 + high))`` and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _covariance(data: PolicyLossInputs) -> torch.Tensor:
    """``(A - mean A)(logp - mean logp)`` over valid tokens (detached; means over this call)."""
    adv, logp, mask = data.advantages.detach(), data.log_prob.detach(), data.response_mask
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))


def vanilla(data: PolicyLossInputs, agg: Aggregation, options: VanillaOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with clip-higher and dual clip (as verl's ``vanilla``).

    ``L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; for ``A < 0`` additionally
    ``L = min(L, -A c)`` (dual-clip PPO), so a huge ratio on a bad token cannot blow the loss up.
    """
    opts = options if options is not None else VanillaOptions()
    if opts.clip_ratio_c <= 1.0:
        raise ValueError(f"vanilla: clip_ratio_c (dual-clip bound) must be > 1, got {opts.clip_ratio_c}")
    mask, adv = data.response_mask, data.advantages
    log_ratio = _log_ratio(data)
    losses, clipped = _clipped_surrogate(torch.exp(log_ratio), adv, *clip_range(opts, "vanilla"))
    dual_bound = -adv * opts.clip_ratio_c
    dual_clipped = (losses > dual_bound) & (adv < 0)
    losses = torch.where(adv < 0, torch.minimum(losses, dual_bound), losses)
    loss = agg_loss(_weighted(losses, data), mask, agg)
    return loss, {
        "pg_loss": float(loss.item()),
        "clip_frac": _frac(clipped, mask),
        "clip_frac_lower": _frac(dual_clipped, mask),
        "approx_kl": _approx_kl(log_ratio, mask),
    }


def clip_cov_selection(data: PolicyLossInputs, options: ClipCovOptions | None = None, clipped: torch.Tensor | None = None) -> torch.Tensor:
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
            _, clipped = _clipped_surrogate(torch.exp(_log_ratio(data)), data.advantages, *clip_range(opts, "clip_cov"))
        cov = _covariance(data)
        candidates = valid & ~clipped & (cov > opts.clip_cov_lb) & (cov < opts.clip_cov_ub)
        k = max(1, int(opts.clip_cov_ratio * int(valid.sum().item())))
        flat = torch.nonzero(candidates.reshape(-1), as_tuple=True)[0]
        chosen = flat[torch.randperm(flat.numel())[:k].to(flat.device)]
        selected = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
        selected[chosen] = True
    return selected.reshape(candidates.shape)


def clip_cov(data: PolicyLossInputs, agg: Aggregation, options: ClipCovOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
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
    losses, clipped = _clipped_surrogate(torch.exp(log_ratio), data.advantages, *clip_range(opts, "clip_cov"))
    selected = clip_cov_selection(data, opts, clipped)
    losses = torch.where(selected, torch.zeros_like(losses), losses)
    loss = agg_loss(_weighted(losses, data), mask, agg)
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


def kl_cov(data: PolicyLossInputs, agg: Aggregation, options: KLCovOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov: ``-A r`` on every token (no clipping), plus ``ppo_kl_coef * |log r|`` on the
    top-k covariance tokens of :func:`kl_cov_selection` (as verl; the penalty uses the clamped
    log-ratio). Extra metrics: ``abs_kl`` (verl's ``ppo_kl`` for this loss), ``kl_cov_frac``."""
    opts = options if options is not None else KLCovOptions()
    mask, adv = data.response_mask, data.advantages
    log_ratio = _log_ratio(data)
    losses = -adv * torch.exp(log_ratio)
    selected = kl_cov_selection(data, opts)
    losses = torch.where(selected, losses + opts.ppo_kl_coef * log_ratio.abs(), losses)
    loss = agg_loss(_weighted(losses, data), mask, agg)
    return loss, {
        "pg_loss": float(loss.item()),
        "kl_cov_frac": _frac(selected, mask),
        "abs_kl": float(masked_mean(log_ratio.detach().abs(), mask).item()),
        "approx_kl": _approx_kl(log_ratio, mask),
    }


def gspo(data: PolicyLossInputs, agg: Aggregation, options: GSPOOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: sequence-level ratio ``s = exp(mean_t log r_t)`` over valid tokens (unclamped log
    ratios, as verl), used per token as ``s_t = sg(s) * pi_t / sg(pi_t)`` (log clamped at 10),
    loss ``max(-A s_t, -A clip(s_t))``, aggregated with ``agg.mode`` (as verl 0.9.1; the paper's
    choice is ``seq-mean-token-mean``)."""
    opts = options if options is not None else GSPOOptions()
    mask, logp = data.response_mask, data.log_prob
    log_ratio = logp - data.old_log_prob
    lengths = masked_count(mask, dim=-1).to(log_ratio.dtype).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / lengths
    log_s = torch.clamp(logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    losses, clipped = _clipped_surrogate(torch.exp(log_s), data.advantages, *clip_range(opts, "gspo"))
    loss = agg_loss(_weighted(losses, data), mask, agg)
    return loss, {
        "pg_loss": float(loss.item()),
        "clip_frac": _frac(clipped, mask),
        "approx_kl": _approx_kl(log_ratio, mask),
    }


def sapo(data: PolicyLossInputs, agg: Aggregation, options: SAPOOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (soft adaptive policy optimisation): a smooth gate instead of a hard clip,
    ``L = -A f(r)`` with ``f(r) = (4 / tau) sigmoid(tau (r - 1))`` (``tau_pos`` where ``A > 0``,
    else ``tau_neg``); ``f'(1) = 1``, so at ``r = 1`` the gradient is PPO's. Always aggregated
    with ``seq-mean-token-mean`` (keeping ``agg.global_seqs``), whatever ``agg.mode`` says, as verl."""
    opts = options if options is not None else SAPOOptions()
    if opts.tau_pos <= 0 or opts.tau_neg <= 0:
        raise ValueError(f"sapo: tau_pos and tau_neg must be > 0, got {opts.tau_pos}, {opts.tau_neg}")
    mask, adv = data.response_mask, data.advantages
    log_ratio = _log_ratio(data)
    tau = torch.where(adv > 0, torch.full_like(adv, opts.tau_pos), torch.full_like(adv, opts.tau_neg))
    gates = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    forced = Aggregation(mode="seq-mean-token-mean", global_seqs=agg.global_seqs)
    loss = agg_loss(_weighted(-gates * adv, data), mask, forced)
    return loss, {"pg_loss": float(loss.item()), "approx_kl": _approx_kl(log_ratio, mask)}


def cispo(data: PolicyLossInputs, agg: Aggregation, options: CISPOOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: ``L = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp``: the importance weight
    is clipped and detached, so every token keeps a gradient ``-w A grad(logp)``."""
    opts = options if options is not None else CISPOOptions()
    mask = data.response_mask
    log_ratio = _log_ratio(data)
    ratio = torch.exp(log_ratio)
    low, high = clip_range(opts, "cispo")
    weight = torch.clamp(ratio, 1.0 - low, 1.0 + high).detach()
    losses = -weight * data.advantages * data.log_prob
    loss = agg_loss(_weighted(losses, data), mask, agg)
    return loss, {
        "pg_loss": float(loss.item()),
        "clip_frac": _frac(ratio.detach() != weight, mask),
        "approx_kl": _approx_kl(log_ratio, mask),
    }


def gmpo(data: PolicyLossInputs, agg: Aggregation, options: GMPOOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
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
    low, high = clip_range(opts, "gmpo")
    bounded = torch.clamp(log_ratio, -low, high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    seq_tokens = masked_count(mask, dim=-1)
    lengths = seq_tokens.to(log_ratio.dtype).clamp(min=1)
    seq_ratio = torch.exp(masked_sum(pessimistic, mask, dim=-1) / lengths)
    seq_adv = masked_sum(adv, mask, dim=-1) / lengths
    seq_losses = -seq_adv * seq_ratio
    if data.rollout_is_weights is not None:
        # one weight per sequence: the geometric mean of its token weights (as verl)
        log_w = masked_sum(torch.log(data.rollout_is_weights + 1e-10), mask, dim=-1) / lengths
        seq_losses = seq_losses * torch.exp(log_w)
    loss = seq_mean(seq_losses, seq_tokens > 0, agg.global_seqs)
    clipped = log_ratio != bounded
    return loss, {
        "pg_loss": float(loss.item()),
        "clip_frac": _frac(clipped & (adv > 0), mask),
        "clip_frac_lower": _frac(clipped & (adv < 0), mask),
        "approx_kl": _approx_kl(log_ratio, mask),
    }


def reinforce(data: PolicyLossInputs, agg: Aggregation, options: ReinforceOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE: ``L = -A logp`` (no ratio, no clipping). ``approx_kl`` is measured against
    ``rollout_log_prob`` when given (the policy that sampled), else against ``old_log_prob``.
    Also registered as ``gpg`` (verl's ``loss_mode: gpg`` is this same loss)."""
    mask = data.response_mask
    losses = -data.advantages * data.log_prob
    loss = agg_loss(_weighted(losses, data), mask, agg)
    behaviour = data.rollout_log_prob if data.rollout_log_prob is not None else data.old_log_prob
    return loss, {
        "pg_loss": float(loss.item()),
        "approx_kl": float(masked_mean((behaviour - data.log_prob).detach(), mask).item()),
    }


def _dppo(data: PolicyLossInputs, agg: Aggregation, opts: DPPOOptions, name: str, inside: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """``L = -A sg(min(r, c)) logp`` on the tokens ``inside`` the trust region (0 elsewhere)."""
    if opts.clip_ratio_c <= 0:
        raise ValueError(f"{name}: clip_ratio_c (ratio truncation) must be > 0, got {opts.clip_ratio_c}")
    mask = data.response_mask
    log_ratio = _log_ratio(data)
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=opts.clip_ratio_c).detach()
    inside = inside.detach()
    losses = torch.where(inside, -data.advantages * truncated * data.log_prob, torch.zeros_like(ratio))
    loss = agg_loss(_weighted(losses, data), mask, agg)
    return loss, {
        "pg_loss": float(loss.item()),
        "clip_frac": _frac(~inside, mask),
        "clip_frac_lower": _frac((ratio > opts.clip_ratio_c) & inside, mask),
        "approx_kl": _approx_kl(log_ratio, mask),
    }


def dppo_tv(data: PolicyLossInputs, agg: Aggregation, options: DPPOOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV (arXiv:2602.04879): a token learns (``-A sg(min(r, c)) logp``) unless its
    probability already moved past the threshold in the advantage's direction:
    ``p - p_old > clip_ratio_high`` for ``A > 0``, ``p - p_old < -clip_ratio_low`` otherwise.
    ``clip_frac``: tokens outside; ``clip_frac_lower``: inside tokens whose ratio was truncated."""
    opts = options if options is not None else DPPOOptions()
    low, high = clip_range(opts, "dppo_tv")
    delta = torch.exp(data.log_prob) - torch.exp(data.old_log_prob)
    inside = torch.where(data.advantages > 0, delta <= high, delta >= -low)
    return _dppo(data, agg, opts, "dppo_tv", inside)


def dppo_kl(data: PolicyLossInputs, agg: Aggregation, options: DPPOOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL: as :func:`dppo_tv` with the binary KL
    ``p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))`` as divergence;
    a token is outside when it exceeds the threshold *and* ``p`` moved in the advantage's
    direction (up for ``A > 0``, down otherwise)."""
    opts = options if options is not None else DPPOOptions()
    low, high = clip_range(opts, "dppo_kl")
    p, p_old = torch.exp(data.log_prob), torch.exp(data.old_log_prob)
    kl = p_old * (data.old_log_prob - data.log_prob) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    inside = torch.where(data.advantages > 0, (kl <= high) | (p <= p_old), (kl <= low) | (p >= p_old))
    return _dppo(data, agg, opts, "dppo_kl", inside)


def dro(data: PolicyLossInputs, agg: Aggregation, options: DROOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO (direct reward optimisation, arXiv:2506.00103 as in verl): policy gradient with a
    quadratic log-ratio penalty, ``L = -(A logp - beta / 2 (logp - logp_old)^2)``."""
    opts = options if options is not None else DROOptions()
    if opts.dro_beta is None or opts.dro_beta <= 0:
        raise ValueError(f"dro: dro_beta must be > 0, got {opts.dro_beta}; set actor.policy_loss.dro_beta")
    mask = data.response_mask
    log_ratio = data.log_prob - data.old_log_prob
    losses = -(data.log_prob * data.advantages - 0.5 * opts.dro_beta * log_ratio.square())
    loss = agg_loss(_weighted(losses, data), mask, agg)
    return loss, {"pg_loss": float(loss.item()), "approx_kl": _approx_kl(log_ratio, mask)}


def bypass_mode(data: PolicyLossInputs, agg: Aggregation, options: BypassOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Bypass mode: the rollout engine's log-probs stand in for the old log-probs.

    The rollout-correction weights and rejection are computed here between the *current*
    log-probs (detached) and ``rollout_log_prob`` (as verl); rejected tokens leave the loss, not
    the normaliser (``agg`` is unchanged). ``loss_type``: ``ppo_clip`` is :func:`vanilla` with
    ``old = rollout`` and no weights; ``reinforce`` is :func:`reinforce` times the weights.
    """
    opts = options if options is not None else BypassOptions()
    if data.rollout_log_prob is None:
        raise ValueError("bypass_mode needs the rollout engine's log-probs (rollout_log_probs); this batch has none")
    if opts.loss_type not in BYPASS_LOSSES:
        raise ValueError(f"bypass_mode: loss_type is {opts.loss_type!r}; valid: {', '.join(BYPASS_LOSSES)}")
    weights, kept, metrics = rollout_correction(data.log_prob, data.rollout_log_prob, data.response_mask, opts)
    inner = dataclasses.replace(data, old_log_prob=data.rollout_log_prob, response_mask=kept, rollout_is_weights=None)
    if opts.loss_type == "ppo_clip":
        loss, loss_metrics = vanilla(inner, agg, opts)
    else:
        loss, loss_metrics = reinforce(dataclasses.replace(inner, rollout_is_weights=weights), agg)
    return loss, {**loss_metrics, **metrics}


# The objective applies no rollout correction of its own around this loss.
bypass_mode.corrects_rollout = True


# name -> (loss, options dataclass); plugin.py registers these.
LOSSES = {
    "vanilla": (vanilla, VanillaOptions),
    "clip_cov": (clip_cov, ClipCovOptions),
    "kl_cov": (kl_cov, KLCovOptions),
    "gspo": (gspo, GSPOOptions),
    "sapo": (sapo, SAPOOptions),
    "cispo": (cispo, CISPOOptions),
    "gmpo": (gmpo, GMPOOptions),
    "geo_mean": (gmpo, GMPOOptions),
    "dppo_tv": (dppo_tv, DPPOOptions),
    "dppo_kl": (dppo_kl, DPPOOptions),
    "dro": (dro, DROOptions),
    "reinforce": (reinforce, ReinforceOptions),
    "gpg": (reinforce, ReinforceOptions),
    "bypass_mode": (bypass_mode, BypassOptions),
}
