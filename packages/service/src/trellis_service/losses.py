"""Tinker's built-in losses on trellis-algos' registered losses: each a *sum* over a Datum's target
positions (Tinker's convention: the caller scales by weights or advantages), from the log-probs of
the target tokens ``(datums, positions)``.

========================  ======================================  ===========================================
Tinker ``loss_fn``        trellis-algos loss (registered name)    options from ``loss_fn_config``
========================  ======================================  ===========================================
``cross_entropy``         ``sft_loss`` ``cross_entropy`` on       none; ``weights`` default 1
                          ``weights * logp``
``importance_sampling``   ``policy_loss`` ``vanilla``, clip range none
                          and dual-clip bound opened
``ppo``                   ``policy_loss`` ``vanilla``, dual clip  ``clip_low_threshold`` (0.8),
                          opened                                  ``clip_high_threshold`` (1.2) on the ratio
``cispo``                 ``policy_loss`` ``cispo``               the same two thresholds
``gspo``                  ``policy_loss`` ``gspo``                the same two thresholds on the sequence
                                                                  ratio (default: trellis's 3e-4 / 4e-4)
``dro``                   ``policy_loss`` ``dro``                 ``beta`` (required, > 0)
========================  ======================================  ===========================================

Every loss aggregates with ``token-sum``. The policy losses read ``logprobs`` (the sampler's) and
``advantages``; all read ``target_tokens``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from trellis import Aggregation, PolicyLossInputs
from trellis_service.errors import UserError

OPEN = 1e9  # a clip bound that never binds
SUM = Aggregation(mode="token-sum")
POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")


@dataclass(frozen=True)
class LossSpec:
    """One Tinker loss: the registered trellis loss it runs, the Datum inputs it reads (required,
    optional) and the ``loss_fn_config`` keys it takes."""

    kind: str
    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config: tuple[str, ...] = ()


THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")
LOSSES = {
    "cross_entropy": LossSpec("sft_loss", "cross_entropy", ("target_tokens",), ("weights",)),
    "importance_sampling": LossSpec("policy_loss", "vanilla", POLICY_INPUTS),
    "ppo": LossSpec("policy_loss", "vanilla", POLICY_INPUTS, config=THRESHOLDS),
    "cispo": LossSpec("policy_loss", "cispo", POLICY_INPUTS, config=THRESHOLDS),
    "gspo": LossSpec("policy_loss", "gspo", POLICY_INPUTS, config=THRESHOLDS),
    "dro": LossSpec("policy_loss", "dro", POLICY_INPUTS, config=("beta",)),
}


def loss_spec(loss_fn: str, config: dict[str, float | str]) -> LossSpec:
    """The spec of ``loss_fn``, its config keys checked; unknown names are refused with the known ones."""
    spec = LOSSES.get(loss_fn)
    if spec is None:
        known = ", ".join(LOSSES)
        raise UserError(f"loss_fn {loss_fn!r} is not supported by this server; supported: {known} (or forward_backward_custom)")
    unknown = sorted(set(config) - set(spec.config))
    if unknown:
        takes = ", ".join(spec.config) or "no keys"
        raise UserError(f"loss_fn_config key(s) {unknown} are not read by {loss_fn!r} (it takes {takes}); remove them")
    for key, value in config.items():
        if not isinstance(value, float | int):
            raise UserError(f"loss_fn_config[{key!r}]={value!r} must be a number")
    return spec


def _options(loss_fn: str, options_class: type, config: dict[str, float]):
    """The registered loss's options for ``loss_fn`` and its ``loss_fn_config``."""
    if loss_fn == "importance_sampling":
        return options_class(clip_ratio=OPEN, clip_ratio_c=OPEN)
    if loss_fn == "dro":
        if "beta" not in config or config["beta"] <= 0:
            raise UserError(f"loss_fn 'dro' needs loss_fn_config['beta'] > 0 (the quadratic penalty's weight); got {config.get('beta')!r}")
        return options_class(dro_beta=float(config["beta"]))
    bounds = {}
    if "clip_low_threshold" in config or loss_fn != "gspo":
        bounds["clip_ratio_low"] = 1.0 - float(config.get("clip_low_threshold", 0.8))
    if "clip_high_threshold" in config or loss_fn != "gspo":
        bounds["clip_ratio_high"] = float(config.get("clip_high_threshold", 1.2)) - 1.0
    if bounds.get("clip_ratio_low", 0.0) < 0 or bounds.get("clip_ratio_high", 0.0) < 0:
        raise UserError(f"loss_fn_config thresholds of {loss_fn!r} must satisfy clip_low_threshold <= 1 <= clip_high_threshold; got {config}")
    options = options_class(**bounds)
    if "clip_ratio_c" in {f.name for f in dataclasses.fields(options_class)}:
        options = dataclasses.replace(options, clip_ratio_c=OPEN)  # Tinker's PPO has no dual clip
    return options


def summed_loss(
    registry, loss_fn: str, config: dict[str, float], logp: torch.Tensor, mask: torch.Tensor, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of ``loss_fn`` summed over the valid positions of every datum.

    logp: ``(datums, positions)`` log-probs of the target tokens (with gradient); mask: which
    positions exist; inputs: the Datum inputs padded to the same shape."""
    spec = LOSSES[loss_fn]
    entry = registry.get(spec.kind, spec.name)
    if spec.kind == "sft_loss":
        weights = inputs.get("weights", torch.ones_like(logp))
        loss, metrics = entry.obj(logp * weights, mask, SUM, None)
        return loss, metrics
    data = PolicyLossInputs(log_prob=logp, old_log_prob=inputs["logprobs"], advantages=inputs["advantages"], response_mask=mask)
    return entry.obj(data, SUM, _options(loss_fn, entry.options, config))
