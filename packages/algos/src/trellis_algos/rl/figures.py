"""The ``rl`` step's figures beside the losses (groups with signal, throughput, the KL in use, a
mixture-of-experts policy's routing) and its truncated samples (``actor.mask_truncated``: counted, and masked out of the actor's loss)."""

from __future__ import annotations

import torch

from trellis import Batch, RewardResult, SamplingParams, last_valid_index
from trellis.kit.recipe import ROUTED_EXPERTS
from trellis_algos.rl.dynamic_sampling import group_has_signal


def groups_with_signal(scores: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    """``reward/groups_with_signal``: the share of prompt groups whose samples differ in reward
    (``scores``, ``groups`` ``(batch,)``); 0 means no group-relative signal at all."""
    return {"reward/groups_with_signal": float(group_has_signal(scores, groups).float().mean())}


def first_groups(scored: RewardResult, n: int) -> torch.Tensor:
    """``(batch,)`` the prompt group of each sample of a generation round (prompt i's ``n``
    samples at rows i*n .. i*n+n-1)."""
    return torch.arange(len(scored.scores)) // n


def truncated(batch: Batch, params: SamplingParams, tokenizer) -> torch.Tensor:
    """``(batch,)`` bool: samples cut by the length limit (``max_new_tokens`` response tokens, the
    last neither the eos token nor a stop token)."""
    mask = batch["response_mask"]
    last = batch["responses"].gather(1, last_valid_index(mask).clamp(min=0)[:, None])[:, 0]
    stops = torch.tensor([tokenizer.eos_token_id, *params.stop_token_ids])
    return (mask.sum(-1) >= params.max_new_tokens) & ~torch.isin(last, stops)


def without_truncated(batch: Batch, params: SamplingParams, tokenizer) -> Batch:
    """``actor.mask_truncated``: a copy of ``batch`` whose truncated samples have a zero
    ``response_mask``, so they leave the actor's loss."""
    out = batch[torch.arange(len(batch))]
    out["response_mask"] = batch["response_mask"] * ~truncated(batch, params, tokenizer)[:, None]
    return out


def throughput(batch: Batch, gen_s: float | None, times: dict[str, float]) -> dict[str, float]:
    """``timing/gen_tokens_per_s`` (response tokens per second of this step's generation) and
    ``timing/update_tokens_per_s`` (prompt + response tokens per second of the actor's update):
    clock figures, kept with the timings."""
    out = {}
    if gen_s:
        out["timing/gen_tokens_per_s"] = float(batch["response_mask"].sum()) / gen_s
    if times.get("timing/update_actor_s"):
        out["timing/update_tokens_per_s"] = float(batch["attention_mask"].sum()) / times["timing/update_actor_s"]
    return out


def kl_summary(update_metrics: dict[str, float], kl_metrics: dict[str, float]) -> dict[str, float]:
    """``actor/kl``: the KL to the reference in use (as a loss term, else in the reward), if any."""
    kl = update_metrics.get("actor/kl_loss", kl_metrics.get("actor/reward_kl"))
    return {} if kl is None else {"actor/kl": kl}


def router_metrics(batch: Batch, outputs: Batch, experts: int) -> dict[str, float]:
    """A mixture-of-experts policy's figures of a step: ``moe/router_entropy`` (the trainer's forward
    ``outputs``), and from the engine's recorded routes, when the batch has them,
    ``moe/load_max/layer{i}``, the busiest expert's share of a layer's routed tokens over the even
    share (1: balanced), and ``moe/routing_flip_rate``, the share of recorded (token, layer) pairs the
    trainer routed to other experts (its ``routing_flips``)."""
    attended = batch["attention_mask"].bool()
    metrics = {"moe/router_entropy": float(outputs["router_entropy"][attended.any(-1)].mean())}
    if ROUTED_EXPERTS not in batch:
        return metrics
    routes = batch[ROUTED_EXPERTS]
    known = (routes[..., 0] >= 0) & attended[..., None]  # (batch, seq_len, layers)
    for layer in range(routes.shape[2]):
        chosen = routes[:, :, layer][known[:, :, layer]].long().flatten()
        if chosen.numel():
            load = torch.bincount(chosen, minlength=experts).float()
            metrics[f"moe/load_max/layer{layer}"] = float(load.max() / load.mean())
    if "routing_flips" in outputs:
        metrics["moe/routing_flip_rate"] = float(outputs["routing_flips"].sum() / known.sum().clamp(min=1))
    return metrics
