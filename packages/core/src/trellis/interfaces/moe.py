"""Mixture-of-experts routing in Hugging Face models: the experts each token was routed to,
recorded while an engine generates and replayed in a trainer's forward (routing replay, "R3"),
and the router's figures a forward returns (entropy, the load-balancing loss)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from trellis.batch import Batch
from trellis.interfaces.rollout import Generation

# The batch field of the experts an engine routed each token to: ``(batch, seq_len, moe_layers, top_k)``
# int16 over prompt + response, in the columns of ``input_ids``; -1 where none was recorded (padding,
# and the last sampled token, which the engine never ran), where the trainer routes by itself.
ROUTED_EXPERTS = "routed_experts"
# Batch meta: ``actor.router_replay`` of the run (``rollout``: replay ROUTED_EXPERTS in the trainer's
# forwards; ``measure``: only count where the trainer's routing differs from them).
ROUTER_REPLAY = "router_replay"
REPLAY_MODES = ("off", "measure", "rollout")
ROUTE_DTYPE = torch.int16
# Forward outputs of a backend that runs MoE models, each ``(batch,)``: router_aux_loss, its
# micro-batch's load-balancing loss (the model's own ``load_balancing_loss_func``, every row the
# same); router_entropy, the sample's mean router entropy over its tokens and MoE layers;
# routing_flips, how many of the sample's recorded (token, layer) pairs the trainer routes to
# other experts than the engine did (before any replay).
MOE_OUTPUTS = ("router_aux_loss", "router_entropy", "routing_flips")

# Router classes by how their chosen experts' weights follow from the logits: a softmax over all
# experts, then the top k (renormalised where the router says so), or the top k logits, then a
# softmax over them. A router class not listed is refused by name rather than replayed wrongly.
SOFTMAX_FIRST = {
    "Qwen2MoeTopKRouter": "norm_topk_prob",
    "Qwen3MoeTopKRouter": "norm_topk_prob",
    "Qwen3NextTopKRouter": "norm_topk_prob",
    "OlmoeTopKRouter": "norm_topk_prob",
    "MixtralTopKRouter": True,
}
TOPK_FIRST = {"GptOssTopKRouter"}


def expert_counts(config: Mapping[str, Any] | Any) -> tuple[int, int] | None:
    """``(experts, top_k)`` of a model config (a ``transformers`` config or its ``config.json``
    dict); None for a dense model."""
    get = config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
    experts = get("num_experts") or get("num_local_experts") or 0
    top_k = get("num_experts_per_tok") or 0
    return (int(experts), int(top_k)) if experts and top_k else None


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers, one per MoE layer in layer order; refuses a router of an unknown rule."""
    found = [m for m in model.modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))]
    unknown = sorted({type(m).__name__ for m in found} - set(SOFTMAX_FIRST) - TOPK_FIRST)
    if unknown:
        raise ValueError(
            f"the router {unknown[0]} of this model is not one Trellis records or replays (known: "
            f"{', '.join(sorted([*SOFTMAX_FIRST, *TOPK_FIRST]))}); set actor.router_replay: off"
        )
    return found


def _weights(router: torch.nn.Module, logits: torch.Tensor, chosen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The router's weights of the ``chosen`` experts ``(tokens, k)``, by its own rule, from ``logits``,
    in ``dtype`` (the router's own weights' dtype)."""
    name = type(router).__name__
    if name in TOPK_FIRST:
        return torch.softmax(logits.gather(-1, chosen), dim=-1, dtype=logits.dtype).to(dtype)
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
    norm = SOFTMAX_FIRST[name]
    if norm is True or getattr(router, str(norm), False):
        top = top / top.sum(-1, keepdim=True)
    return top.to(dtype)


@contextlib.contextmanager
def recorded_routes(model: torch.nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """While inside, every forward's chosen experts: one list per forward call, of each MoE layer's
    ``(tokens, top_k)`` indices in the rows the routers saw (``batch * seq_len``, row-major)."""
    calls: list[list[torch.Tensor]] = []
    layers = routers(model)

    def hook(index: int):
        def record(module, args, output) -> None:
            if index == 0:
                calls.append([])
            calls[-1].append(output[2].detach().to("cpu", ROUTE_DTYPE))

        return record

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(layers)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def generated_routes(calls: list[list[torch.Tensor]], rows: int) -> torch.Tensor:
    """``(rows, columns run, layers, top_k)`` routes of a ``generate`` call from :func:`recorded_routes`'
    calls: the prompt's forward, then one per token (the last sampled token is never run)."""
    return torch.cat([torch.stack(layers, 1).reshape(rows, -1, len(layers), layers[0].shape[-1]) for layers in calls], 1)


def conversation_routes(sequence: list[int], turns: list[Generation]) -> torch.Tensor | None:
    """A conversation's routes ``(len(sequence), layers, top_k)`` (its prompt and response ids) from
    its model turns' (``Generation.routes``): each position from the first turn that ran it, as an
    engine's prefix cache keeps it, and only from a turn whose input is the conversation's own prefix
    (a loop that re-rendered the context did not run these tokens); -1 where no turn did. None when
    no turn recorded any."""
    recorded = [gen.routes for gen in turns if gen.routes is not None]
    if not recorded:
        return None
    out = torch.full((len(sequence), *recorded[0].experts.shape[1:]), -1, dtype=ROUTE_DTYPE)
    covered = 0
    for routes in recorded:
        n = len(routes.input_ids)
        if n > covered and sequence[:n] == routes.input_ids:
            out[covered:n] = routes.experts[covered:n]
            covered = n
    return out


def batch_routes(trajectory_routes: list[torch.Tensor | None], prompt_lengths: list[int], prompt_width: int, width: int) -> torch.Tensor:
    """Samples' :func:`conversation_routes` laid out in the ``rollout_batch`` columns: ``(samples,
    prompt_width + width, layers, top_k)``, each sample's prompt ending at column ``prompt_width``;
    -1 elsewhere (and for a sample without routes)."""
    shape = next(r for r in trajectory_routes if r is not None).shape[1:]
    out = torch.full((len(trajectory_routes), prompt_width + width, *shape), -1, dtype=ROUTE_DTYPE)
    for i, (routes, prompt) in enumerate(zip(trajectory_routes, prompt_lengths)):
        if routes is not None:
            out[i, prompt_width - prompt : prompt_width - prompt + len(routes)] = routes
    return out


class RouterHooks:
    """Forward hooks on a model's routers, installed once (:meth:`on`) and armed for each forward
    (:meth:`arm`): replay or compare the recorded ``routes`` ``(tokens, layers, top_k)`` (-1: none),
    and keep each layer's logits when the router outputs are wanted. They stay armed until the next
    forward arms them again, so the recomputation of an activation checkpoint in the backward
    replays the same experts as its forward did."""

    ATTRIBUTE = "_trellis_router_hooks"

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = routers(model)
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.layers)]
        self.arm(None, replay=False, keep_logits=False)

    @classmethod
    def on(cls, model: torch.nn.Module) -> RouterHooks:
        """The model's hooks, installed on first use."""
        hooks = getattr(model, cls.ATTRIBUTE, None)
        if hooks is None:
            hooks = cls(model)
            setattr(model, cls.ATTRIBUTE, hooks)
        return hooks

    def arm(self, routes: torch.Tensor | None, replay: bool, keep_logits: bool) -> RouterHooks:
        if routes is not None and routes.shape[1] != len(self.layers):
            raise ValueError(
                f"{ROUTED_EXPERTS} holds {routes.shape[1]} MoE layers, the model has {len(self.layers)}: the routes were recorded on another model"
            )
        self.routes, self.replay, self.keep_logits = routes, replay, keep_logits
        self.logits: list[torch.Tensor] = []  # each layer's of the forward (not of a recomputation)
        self.flips: list[torch.Tensor] = []  # (tokens,) per layer: the trainer's own experts differ from the record
        return self

    def _hook(self, index: int):
        def hook(module, args, output):
            logits, weights, chosen = output
            if self.keep_logits and len(self.logits) < len(self.layers):
                self.logits.append(logits)
            if self.routes is None:
                return None
            recorded = self.routes[:, index].to(chosen.device, chosen.dtype)
            known = recorded[:, 0] >= 0
            if len(self.flips) < len(self.layers):
                differ = (chosen.sort(-1).values != recorded.sort(-1).values).any(-1)
                self.flips.append((differ & known).detach())
            if not self.replay:
                return None
            chosen = torch.where(known[:, None], recorded, chosen)
            return logits, _weights(module, logits, chosen, weights.dtype), chosen

        return hook

    def outputs(self, model: torch.nn.Module, names: tuple[str, ...], rows: torch.Tensor, attended: torch.Tensor) -> dict[str, torch.Tensor]:
        """The named :data:`MOE_OUTPUTS` ``(batch,)``; ``rows`` ``(batch, seq_len)`` gives each
        position's router row (-1: none), ``attended`` which positions count."""
        out = {}
        where = attended & (rows >= 0)
        picked = rows.clamp(min=0).to(self.logits[0].device if self.logits else "cpu")
        if "router_entropy" in names:
            per_layer = [_entropy(logits)[picked] for logits in self.logits]  # (batch, seq_len) each
            total = torch.stack(per_layer).sum(0) * where.to(per_layer[0].device)
            out["router_entropy"] = total.sum(-1) / (where.sum(-1).to(total.device) * len(per_layer)).clamp(min=1)
        if "routing_flips" in names:
            flips = torch.stack(self.flips).sum(0)[picked.to(self.flips[0].device)] if self.flips else torch.zeros(rows.shape)
            out["routing_flips"] = (flips * where.to(flips.device)).sum(-1).float()
        if "router_aux_loss" in names:
            out["router_aux_loss"] = aux_loss(model, self.logits, where, rows).expand(len(rows))
        return out


def own_routing(model: torch.nn.Module) -> None:
    """From here on ``model`` routes every token by itself: a forward without routes (an earlier
    micro-batch's stay out), or an engine generating from the trainer's own module."""
    hooks = getattr(model, RouterHooks.ATTRIBUTE, None)
    if hooks is not None:
        hooks.arm(None, replay=False, keep_logits=False)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(log_p.exp() * log_p).sum(-1).detach()


def aux_loss(model: torch.nn.Module, logits: list[torch.Tensor], where: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The model's load-balancing loss (its module's ``load_balancing_loss_func``, as the model adds
    it with ``output_router_logits``) over the router rows of the attended positions ``where``."""
    loss_fn = importlib.import_module(type(model).__module__).load_balancing_loss_func
    kept = rows[where].to(logits[0].device)
    experts, top_k = expert_counts(model.config)
    return loss_fn(tuple(layer[kept] for layer in logits), experts, top_k)


def mark_replay(batch: Batch, mode: str, engine: str) -> None:
    """Mark ``batch`` with ``actor.router_replay`` ``mode`` for the forwards of the policy; its
    engine (named ``engine``) must have recorded the routes."""
    if mode == "off":
        return
    if ROUTED_EXPERTS not in batch:
        raise RuntimeError(
            f"actor.router_replay={mode!r} needs each token's experts from the rollout engine, and rollout engine {engine!r} "
            f"returned none ({ROUTED_EXPERTS}); use an engine that records them (hf) or set actor.router_replay: off"
        )
    batch.meta[ROUTER_REPLAY] = mode


@contextlib.contextmanager
def without_replay(batch: Batch) -> Iterator[Batch]:
    """``batch`` unmarked while inside (a forward of another model than the policy: a teacher)."""
    mode = batch.meta.pop(ROUTER_REPLAY, None)
    try:
        yield batch
    finally:
        if mode is not None:
            batch.meta[ROUTER_REPLAY] = mode


def refuse_lost_routes(batch: Batch, reads: tuple[str, ...], who: str) -> None:
    """Refuse ``batch`` marked for replay when ``who`` runs the model on it (``reads`` has
    ``input_ids``) without reading the routes: it would train on its own routing, unsaid."""
    if batch.meta.get(ROUTER_REPLAY) == "rollout" and "input_ids" in reads and ROUTED_EXPERTS not in reads:
        raise ValueError(
            f"{who} takes no recorded routes ({ROUTED_EXPERTS} is not among its model_inputs), but actor.router_replay is "
            "rollout; use a backend that replays them (fsdp) or set actor.router_replay: off"
        )
