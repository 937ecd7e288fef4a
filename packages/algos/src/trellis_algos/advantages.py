"""Advantage estimators (kind ``advantage``): gae, grpo, grpo_passk, gdpo, rloo, reinforce_plus_plus(_baseline),
remax, opo, gpg; ``grpo_vectorized`` and ``rloo_vectorized`` are verl's names for grpo and rloo.

Each is ``fn(data: AdvantageInputs, options) -> (advantages, returns)``, both ``(batch, response_len)``
and zero on masked tokens. Outcome estimators use the sequence score ``R = sum of token_rewards over
valid tokens`` (verl sums over every position; the reward sits on the last valid token, so the two
agree unless something was put on a padding or environment token, which is then ignored here).
Groups (``group_ids``) are the samples of one prompt; a group of one sample gets baseline 0.
Everything runs without gradient. ``options=None`` means the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trellis import AdvantageInputs, choice, ranged
from trellis_algos.stats import group_index, group_mean_std, group_sum, masked_sum, masked_whiten

GPG_ALPHA_FROM = ("nonzero_rewards", "nonzero_advantages")


@dataclass
class GAEOptions:
    """gamma: discount per generated token; lam: GAE lambda."""

    gamma: float = ranged(1.0, ge=0, le=1)
    lam: float = ranged(1.0, ge=0, le=1)


@dataclass
class GRPOOptions:
    """norm_by_std: divide by the group std (False: Dr. GRPO); epsilon: added to the std."""

    norm_by_std: bool = True
    epsilon: float = ranged(1e-6, ge=0)


@dataclass
class GDPOOptions:
    """reward_keys: comma-separated reward components normalised separately (keys of the dict the
    reward function returns besides ``score``), e.g. ``format,accuracy``; reward_weights:
    comma-separated weights, one per key (empty: all 1); norm_by_std, epsilon: as grpo, per
    component."""

    reward_keys: str = ""
    reward_weights: str = ""
    norm_by_std: bool = True
    epsilon: float = ranged(1e-6, ge=0)


@dataclass
class ReinforcePlusPlusOptions:
    """gamma: discount per generated token for the return."""

    gamma: float = ranged(1.0, ge=0, le=1)


@dataclass
class GPGOptions:
    """alpha_from: ``nonzero_rewards`` (verl: alpha = batch / #samples with a non-zero score) or
    ``nonzero_advantages`` (alpha = batch / #samples with a non-zero ``R - mean_g``, i.e. those
    that carry a gradient); f_norm: divisor of the advantage."""

    alpha_from: str = choice("nonzero_rewards", GPG_ALPHA_FROM)
    f_norm: float = ranged(1.0, gt=0)


def require_inputs(data: AdvantageInputs, name: str, fields: tuple[str, ...], hint: str = "") -> None:
    """Every ``AdvantageInputs`` field in ``fields`` (what estimator ``name`` declares in ``needs``)
    is given; a recipe that does not read ``needs`` is told which one is missing and how to fill it."""
    for field in fields:
        if getattr(data, field) is None:
            raise ValueError(
                f"advantage {name!r} needs AdvantageInputs.{field}, which is None; the rl recipe fills it from the estimator's "
                f"needs ({', '.join(fields)}{hint}); a custom recipe must pass it"
            )


def _scores(data: AdvantageInputs) -> torch.Tensor:
    return masked_sum(data.token_rewards, data.response_mask, dim=-1)


def _per_token(scalars: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast ``(batch,)`` to ``(batch, response_len)``, zero on masked tokens."""
    return torch.where(mask.bool(), scalars.unsqueeze(-1), torch.zeros((), dtype=scalars.dtype, device=scalars.device))


@torch.no_grad()
def gae(data: AdvantageInputs, options: GAEOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (PPO with a critic).

    Backwards over valid tokens only: ``delta_t = r_t + gamma V_next - V_t`` where ``V_next`` is the
    value of the next *valid* token (0 after the last), ``A_t = delta_t + gamma lam A_next``;
    environment tokens of a multi-turn response are skipped (they neither discount nor add).
    ``returns = A + V`` (before whitening), then ``A`` is whitened over all valid tokens.
    As verl, except that advantages and returns are zeroed on masked tokens.
    """
    opts = options if options is not None else GAEOptions()
    if data.values is None:
        raise ValueError("advantage 'gae' needs critic values: AdvantageInputs.values is None")
    rewards, values = data.token_rewards, data.values.detach().to(data.token_rewards.dtype)
    valid = data.response_mask.bool()
    batch, length = rewards.shape
    next_value = rewards.new_zeros(batch)
    running = rewards.new_zeros(batch)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        delta = rewards[:, t] + opts.gamma * next_value - values[:, t]
        candidate = delta + opts.gamma * opts.lam * running
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        running = torch.where(valid[:, t], candidate, running)
        advantages[:, t] = running
    returns = torch.where(valid, advantages + values, torch.zeros_like(values))
    return masked_whiten(advantages, valid), returns


def _group_normalised(scores: torch.Tensor, group_ids: torch.Tensor, opts: GRPOOptions | GDPOOptions) -> torch.Tensor:
    """``(R - mean_g) / (std_g + epsilon)`` (or ``R - mean_g``) per sample, ``(batch,)``."""
    mean, std, _ = group_mean_std(scores, group_ids)
    return (scores - mean) / (std + opts.epsilon) if opts.norm_by_std else scores - mean


@torch.no_grad()
def grpo(data: AdvantageInputs, options: GRPOOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``A = (R - mean_g) / (std_g + epsilon)`` with the unbiased group std; a group of one
    has mean 0 and std 1. ``norm_by_std=False``: ``A = R - mean_g`` (Dr. GRPO). Returns = A."""
    opts = options if options is not None else GRPOOptions()
    adv = _per_token(_group_normalised(_scores(data), data.group_ids, opts), data.response_mask)
    return adv, adv


def _weighted_components(data: AdvantageInputs, opts: GDPOOptions) -> list[tuple[float, torch.Tensor]]:
    """``(weight, per-sample component (batch,))`` for each of ``reward_keys``, checked."""
    keys = [k.strip() for k in opts.reward_keys.split(",") if k.strip()]
    if not keys:
        raise ValueError(
            "advantage 'gdpo' needs algorithm.advantage.reward_keys, the comma-separated reward components to "
            "normalise separately (keys your reward function's dict returns besides 'score'), e.g. reward_keys=format,accuracy"
        )
    weights = [1.0] * len(keys)
    if opts.reward_weights.strip():
        try:
            weights = [float(w) for w in opts.reward_weights.split(",")]
        except ValueError:
            weights = []
        if len(weights) != len(keys):
            raise ValueError(
                f"algorithm.advantage.reward_weights={opts.reward_weights!r} must be {len(keys)} comma-separated numbers, "
                f"one per reward key ({', '.join(keys)}), or empty for equal weights"
            )
    found = data.reward_components or {}
    missing = [k for k in keys if k not in found]
    if missing:
        raise ValueError(
            f"advantage 'gdpo': reward component(s) {missing} of algorithm.advantage.reward_keys are not among the "
            f"reward's components {sorted(found)}; the reward function must return a dict holding them"
        )
    return [(w, found[k]) for w, k in zip(weights, keys)]


@torch.no_grad()
def gdpo(data: AdvantageInputs, options: GDPOOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: each reward component ``c_k`` ``(batch,)`` normalised within its group as grpo,
    ``A_k = (c_k - mean_g) / (std_g + epsilon)``; ``A = whiten(sum_k w_k A_k)`` over the batch's
    valid tokens. A sample without a valid token counts with components 0 (its reward sits on no
    valid token, as for every outcome estimator here). Returns = A."""
    opts = options if options is not None else GDPOOptions()
    valid = data.response_mask.bool()
    total = torch.zeros(valid.shape[0], dtype=data.token_rewards.dtype, device=valid.device)
    for weight, component in _weighted_components(data, opts):
        scores = torch.where(valid.any(-1), component.to(total), torch.zeros_like(total))
        total = total + weight * _group_normalised(scores, data.group_ids, opts)
    adv = masked_whiten(_per_token(total, valid), valid)
    return adv, adv


@torch.no_grad()
def grpo_passk(data: AdvantageInputs, options: GRPOOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (arXiv:2503.19595): only the best sample of each group learns, with
    ``A = (R_max - R_second) / (std_g + epsilon)`` (without the division when ``norm_by_std`` is
    False); the others get 0. The first of tied best samples is the one. Every group needs at
    least two samples. Returns = A."""
    opts = options if options is not None else GRPOOptions()
    scores = _scores(data)
    inverse, n_groups = group_index(data.group_ids, scores.device)
    _, std, size = group_mean_std(scores, data.group_ids)
    if bool((size < 2).any()):
        raise ValueError(f"grpo_passk needs at least 2 samples per group; group sizes here: {sorted(set(size.long().tolist()))}")
    adv = torch.zeros_like(scores)
    for g in range(n_groups):
        members = torch.nonzero(inverse == g, as_tuple=True)[0]
        top = torch.topk(scores[members], 2)
        best = members[top.indices[0]]
        gap = top.values[0] - top.values[1]
        adv[best] = gap / (std[best] + opts.epsilon) if opts.norm_by_std else gap
    adv = _per_token(adv, data.response_mask)
    return adv, adv


@torch.no_grad()
def rloo(data: AdvantageInputs, options: None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: leave-one-out baseline, ``A = R - mean of the others = n/(n-1) (R - mean_g)``.
    A group of one keeps its raw score (as verl). Returns = A."""
    scores = _scores(data)
    mean, _, size = group_mean_std(scores, data.group_ids)
    factor = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.ones_like(size))
    adv = _per_token(factor * (scores - mean), data.response_mask)
    return adv, adv


@torch.no_grad()
def reinforce_plus_plus(data: AdvantageInputs, options: ReinforcePlusPlusOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go ``G_t = r_t + gamma G_next`` over valid tokens
    (starting from 0 after the last valid token), then whitened over the batch's valid tokens.

    Environment tokens of a multi-turn response are skipped (no reward, no discount, no reset),
    as verl 0.9.1, which carries the running return across masked tokens. Returns (unwhitened)
    are zeroed where masked (verl too).
    """
    opts = options if options is not None else ReinforcePlusPlusOptions()
    rewards, valid = data.token_rewards, data.response_mask.bool()
    running = rewards.new_zeros(rewards.shape[0])
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + opts.gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    return masked_whiten(returns, valid), returns


@torch.no_grad()
def reinforce_plus_plus_baseline(data: AdvantageInputs, options: None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: ``R - mean_g`` on every valid token, then whitened over the batch's
    valid tokens (so the normalisation is token-weighted, as verl). Returns = A."""
    scores = _scores(data)
    mean, _, _ = group_mean_std(scores, data.group_ids)
    adv = masked_whiten(_per_token(scores - mean, data.response_mask), data.response_mask)
    return adv, adv


@torch.no_grad()
def remax(data: AdvantageInputs, options: None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: the greedy rollout's reward as baseline. ``returns_t`` = sum of rewards of valid
    tokens from t on; ``A_t = returns_t - R_greedy`` (= ``R - R_greedy`` for outcome rewards)."""
    if data.baseline_rewards is None:
        raise ValueError("advantage 'remax' needs the greedy rollout's rewards: AdvantageInputs.baseline_rewards is None")
    valid = data.response_mask.bool()
    kept = torch.where(valid, data.token_rewards, torch.zeros_like(data.token_rewards))
    returns = torch.where(valid, kept.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(kept))
    adv = returns - _per_token(data.baseline_rewards.to(returns.dtype), valid)
    return adv, returns


@torch.no_grad()
def opo(data: AdvantageInputs, options: None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: length-weighted group baseline ``b = sum_j len_j R_j / sum_j len_j``, ``A = R - b``
    (no std division); a group of one (or of empty responses) has ``b = 0``. Returns = A."""
    scores = _scores(data)
    lengths = data.response_mask.bool().sum(-1).to(torch.float64)
    inverse, n_groups = group_index(data.group_ids, scores.device)
    size = group_sum(torch.ones_like(lengths), inverse, n_groups)
    weight = group_sum(lengths, inverse, n_groups)
    weighted = group_sum(lengths * scores.to(torch.float64), inverse, n_groups)
    baseline = torch.where((size > 1) & (weight > 0), weighted / weight.clamp(min=1), torch.zeros_like(weight))
    adv = _per_token(scores - baseline[inverse].to(scores.dtype), data.response_mask)
    return adv, adv


@torch.no_grad()
def gpg(data: AdvantageInputs, options: GPGOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: ``A = alpha (R - mean_g) / f_norm`` with ``alpha = batch / max(1, M)``.

    ``M`` (``alpha_from``): ``nonzero_rewards`` counts samples with a non-zero score (verl's
    definition and the issue's, the default); ``nonzero_advantages`` counts samples whose
    ``R - mean_g`` is non-zero, the samples that actually carry a gradient (in the spirit of the
    paper's accurate-gradient-estimation factor: groups whose rewards are all equal contribute
    nothing, so the mean gradient is rescaled by the share of samples that do). Returns = A.
    """
    opts = options if options is not None else GPGOptions()
    scores = _scores(data)
    mean, _, _ = group_mean_std(scores, data.group_ids)
    if opts.alpha_from == "nonzero_rewards":
        m = torch.count_nonzero(scores)
    elif opts.alpha_from == "nonzero_advantages":
        m = torch.count_nonzero(scores - mean)
    else:
        raise ValueError(f"gpg alpha_from is {opts.alpha_from!r}; valid: {', '.join(GPG_ALPHA_FROM)}")
    alpha = scores.shape[0] / m.clamp(min=1).to(scores.dtype)
    adv = _per_token(alpha * (scores - mean) / opts.f_norm, data.response_mask)
    return adv, adv


# name -> (estimator, options dataclass or None); plugin.py registers these.
ESTIMATORS = {
    "gae": (gae, GAEOptions),
    "grpo": (grpo, GRPOOptions),
    "grpo_vectorized": (grpo, GRPOOptions),
    "grpo_passk": (grpo_passk, GRPOOptions),
    "gdpo": (gdpo, GDPOOptions),
    "rloo": (rloo, None),
    "rloo_vectorized": (rloo, None),
    "reinforce_plus_plus": (reinforce_plus_plus, ReinforcePlusPlusOptions),
    "reinforce_plus_plus_baseline": (reinforce_plus_plus_baseline, None),
    "remax": (remax, None),
    "opo": (opo, None),
    "gpg": (gpg, GPGOptions),
}


# What an estimator needs beyond rewards; the rl recipe reads ``needs`` to set up a critic or a
# greedy rollout, so a plugin's estimator can ask for the same.
gae.needs = ("values",)
remax.needs = ("greedy_baseline",)
gdpo.needs = ("reward_components", "groups")
for _grouped in (grpo, grpo_passk, rloo, reinforce_plus_plus_baseline, gpg):
    _grouped.needs = ("groups",)
opo.needs = ("groups", "on_policy_only")
