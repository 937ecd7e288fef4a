"""Role workers: one named role (actor, critic, ref, a teacher, ...) on one rank, hosted by a controller.

``RoleWorker`` drives a backend's model (``trellis.interfaces.backend``) with the batch plan
(``trellis.runtime.plan``) and the objectives the recipe names (kind ``objective``): the backend
runs forwards, backwards and optimizer steps, the objective turns forward outputs into losses,
and this class holds the loop between them. Controllers call workers only by verb; ``routes()``
says how each verb is dealt over the role's mesh and which ``Batch`` fields it reads.
"""

from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trellis.batch import Batch, pad_columns
from trellis.interfaces.backend import Backend, BackendSpec, DistInfo, WeightBucket
from trellis.interfaces.dispatch import ALL, DP_SPLIT, RANK0, Route
from trellis.interfaces.signatures import OBJECTIVE
from trellis.rng import stream_seed
from trellis.runtime.plan import Plan

# a micro-batch's meta key marking a zero-weight copy that keeps the ranks' collectives in step
PADDING = "zero_weight_padding"
# verbs whose Batch argument is a forward's input: they ship the backend's model inputs and ``responses``
FORWARD_VERBS = ("forward", "log_prob", "values", "score")
# every other verb a worker serves, and how it is dealt over the ranks
STATE_ROUTES = {
    "export_weights": Route(RANK0),
    "weight_shapes": Route(RANK0),
    "load_weights": Route(ALL),
    "offload": Route(ALL),
    "onload": Route(ALL),
    "close": Route(ALL),
    "save": Route(ALL),
    "load": Route(ALL),
}


class Worker(ABC):
    """What a controller hosts on a rank: ``build()`` once, then verbs by name as ``routes()`` says.
    ``adapter``: the LoRA adapter the role trains (its ``AdapterConfig``), None for full weights;
    a rollout engine with ``adapter_sync`` then gets the adapter alone (``export_adapter``)."""

    adapter: Any = None

    @abstractmethod
    def build(self) -> None:
        """Load what the role needs (called in the rank's process)."""

    def routes(self) -> dict[str, Route]:
        """Verb -> how it is dealt over the ranks and what it reads."""
        return dict(STATE_ROUTES)

    def close(self) -> None:
        """End of the run (the controller's shutdown). Default: nothing."""

    def full_module(self) -> torch.nn.Module | None:
        """A whole causal LM a rollout engine in this process may generate from (see
        ``Backend.full_module``). Default: None."""
        return None


@dataclass
class WorkerSpec:
    """Everything a role worker needs. A role is data: any name, a model, a head and the
    objectives of its training verbs.

    make_backend: the registered backend factory; options: its options instance.
    head: the model's head, ``lm`` (a causal LM) or ``value`` (one value per token), or any other
        head the backend builds.
    role_options: the role's config section (``ActorConfig``, ``CriticConfig``, ``SFTTrainConfig``...):
        the optimizer (``optim``) and the batch plan.
    objectives: training verb -> registered ``objective`` name, e.g. ``{"update": "policy"}``;
        any verb name a recipe chooses (not one of the worker's other verbs); the worker trains
        (gets an optimizer) only when it has objectives.
    registry: where objectives (and the components they name) are looked up.
    """

    role: str
    model_path: str
    make_backend: Callable[[BackendSpec], Backend]
    options: Any = None
    role_options: Any = None
    objectives: dict[str, str] = field(default_factory=dict)
    dist: DistInfo = field(default_factory=DistInfo)
    registry: Any = None
    seed: int = 0
    total_steps: int = 0
    head: str = "lm"


class RoleWorker(Worker):
    """One role on one rank: a backend's model driven by objectives and the batch plan."""

    def __init__(self, spec: WorkerSpec) -> None:
        taken = sorted(set(spec.objectives) & {*FORWARD_VERBS, *STATE_ROUTES, "train", "evaluate"})
        if taken:
            raise ValueError(f"role {spec.role!r}: training verbs {taken} are names of the worker's other verbs; name them otherwise")
        self.spec = spec
        self.plan = Plan.of(spec.role_options)
        self.objectives: dict[str, Any] = {}
        self.declared: dict[str, dict[str, Any]] = {}
        self.adapter = None  # the role's AdapterConfig once built, when it trains one

    def build(self) -> None:
        spec = self.spec
        self.objectives = {verb: spec.registry.get("objective", name).obj(spec.role_options, spec.registry) for verb, name in spec.objectives.items()}
        # what each declares of the Objective interface (prefix, first_forward), read once
        self.declared = {verb: OBJECTIVE.read("objective", spec.objectives[verb], objective) for verb, objective in self.objectives.items()}
        trainable = bool(self.objectives)  # a role with objectives trains: it gets an optimizer
        optim = spec.role_options.optim if trainable else None
        adapter = getattr(spec.role_options, "adapter", None)
        self.adapter = adapter = adapter if adapter is not None and adapter.rank > 0 else None
        self.backend = spec.make_backend(
            BackendSpec(spec.role, spec.model_path, spec.options, trainable, spec.head, optim, spec.dist, spec.seed, spec.total_steps, adapter)
        )
        if adapter is not None and not self.backend.adapters:
            raise ValueError(
                f"config key '{spec.role}.adapter.rank'={adapter.rank}: backend {type(self.backend).__name__} trains full weights only; "
                f"set {spec.role}.adapter.rank=0 or use backend.name=fsdp"
            )
        for verb, objective in self.objectives.items():
            self._check_outputs(objective.outputs, f"objective {spec.objectives[verb]!r} of verb {verb!r}")
        self.backend.build()

    def routes(self) -> dict[str, Route]:
        routes = super().routes()
        taken = sorted(set(self.backend.verbs) & {*routes, *FORWARD_VERBS, *self.objectives, "train", "evaluate"})
        if taken:
            raise ValueError(f"backend {type(self.backend).__name__} declares verbs {taken}, which the role worker serves; name them otherwise")
        routes.update(self.backend.verbs)
        reads = (*self.backend.model_inputs, "responses")
        routes.update({verb: Route(DP_SPLIT, reads) for verb in FORWARD_VERBS})
        for verb, objective in self.objectives.items():
            routes[verb] = Route(DP_SPLIT, (*self.backend.model_inputs, *objective.inputs), method="train")
        return routes

    def _check_outputs(self, outputs: Iterable[str], who: str) -> None:
        missing = [o for o in outputs if o not in self.backend.outputs]
        if missing:
            raise ValueError(
                f"{who} needs forward outputs {missing}, which backend {type(self.backend).__name__} (role {self.spec.role!r}, "
                f"head {self.spec.head!r}) does not provide; it provides {', '.join(self.backend.outputs)}"
            )

    # -- forwards ------------------------------------------------------------------------------
    def _micro_batches(self, batch: Batch) -> tuple[list[Batch], int, torch.Tensor | None]:
        """This rank's micro-batches of ``batch``, how many of them are real, and the order of
        ``batch``'s samples in them (None: unchanged). With a token budget the samples go
        longest first (``Plan.length_order``), and each rank cuts its own number, but a sharded
        backend runs collectives in every forward and backward: all data-parallel ranks are
        padded to the largest count with zero-weight one-sample micro-batches (marked
        ``PADDING``), so none waits forever."""
        order = self.plan.length_order(batch)
        micros = self.plan.micro_batches(batch if order is None else batch.reorder(order))
        real = len(micros)
        dist = self.spec.dist
        if self.plan.max_tokens_per_micro_batch > 0 and dist.dp_size > 1 and micros:
            # the maximum through the one collective every backend has: each rank fills its own slot
            counts = self.backend.all_reduce_sum([float(real) if r == dist.dp_rank else 0.0 for r in range(dist.dp_size)])
            pad = micros[-1][[0]]
            pad.meta[PADDING] = True
            micros += [pad] * (int(max(counts)) - real)
        return micros, real, order

    def forward(self, batch: Batch, outputs: tuple[str, ...]) -> Batch:
        """The named forward ``outputs`` (any the backend declares in ``Backend.outputs``) for
        ``batch``, in its order; response-length outputs are ``(batch, response_len)`` with 0 at
        padding positions."""
        self._check_outputs(outputs, f"forward of role {self.spec.role!r}")
        micros, real, order = self._micro_batches(batch)
        parts = self.backend.forward(micros, tuple(outputs))[:real]
        back = slice(None) if order is None else torch.argsort(order)  # the batch's own order again
        if "responses" not in batch or "attention_mask" not in batch:
            return Batch({k: torch.cat([p[k] for p in parts])[back] for k in outputs})
        # micro-batches come back as wide as their trimmed responses: pad to the batch's again,
        # with 0 at every padding position whichever way the micro-batches were cut
        width = batch["responses"].shape[1]
        attended = batch["attention_mask"][:, -width:].bool()
        out = {k: torch.cat([_right_pad(p[k], width) for p in parts])[back] for k in outputs}
        return Batch({k: v.masked_fill(~attended.reshape(*attended.shape, *(1,) * (v.dim() - 2)), 0) if v.dim() >= 2 else v for k, v in out.items()})

    def log_prob(self, batch: Batch, with_entropy: bool = False, with_sum_sq_probs: bool = False) -> Batch:
        """``log_probs`` (and ``entropy``, ``sum_sq_probs``) ``(batch, response_len)`` of the
        response tokens at ``batch.meta["temperature"]``; reads ``input_ids``, ``attention_mask``,
        ``position_ids`` ``(batch, seq_len)`` and ``responses`` ``(batch, response_len)``."""
        extra = ("entropy",) * with_entropy + ("sum_sq_probs",) * with_sum_sq_probs
        return self.forward(batch, ("log_probs", *extra))

    def values(self, batch: Batch) -> Batch:
        """A value head's ``values`` ``(batch, response_len)`` for the same inputs as ``log_prob``."""
        return self.forward(batch, ("values",))

    def score(self, batch: Batch) -> Batch:
        """A value head's ``scores`` ``(batch,)`` at each sequence's last attended token."""
        return self.forward(batch, ("scores",))

    # -- training ------------------------------------------------------------------------------
    def _objective(self, verb: str) -> Any:
        if verb not in self.objectives:
            raise NotImplementedError(f"role {self.spec.role!r} was built without an objective for {verb!r} (objectives: {self.spec.objectives})")
        return self.objectives[verb]

    def _global_counts(self, objective: Any, mini: Batch):
        """The objective's counts of this rank's part of the mini-batch, summed over ranks."""
        local = objective.counts(mini)
        names = [n for n in ("global_tokens", "global_seqs") if getattr(local, n) is not None]
        return dataclasses.replace(local, **dict(zip(names, self.backend.all_reduce_sum([getattr(local, n) for n in names]))))

    def train(self, verb: str, batch: Batch) -> dict[str, float]:
        """Train ``verb``'s objective on this rank's share of the step (``batch.meta["step"]``
        seeds the shuffle): epochs over mini-batches (one optimizer step each) of micro-batches;
        the LR schedule steps once per call. Metrics ``<prefix>/...`` (the objective's
        ``prefix``, else the role's name): summed metrics (the objective's losses) add up the
        micro-batches' shares over ranks; the others are averaged; ``<prefix>/optimizer_steps``
        counts the update's optimizer steps (epochs x mini-batches).

        An objective that declares ``first_forward`` (the field of the sampling policy's
        log-probs, e.g. ``old_log_probs``) gets it from the update's own first forward, detached,
        when the batch has none (one optimizer step per batch only); ``<prefix>/entropy`` is then
        that forward's token-mean entropy."""
        objective = self._objective(verb)
        first_forward = self._first_forward(verb, batch)
        prefix = self.declared[verb]["prefix"] or self.spec.role
        outputs = objective.outputs + ("entropy",) * (first_forward is not None and "entropy" not in objective.outputs)
        seed = stream_seed(self.spec.seed, 7919 * (int(batch.meta.get("step", 1)) - 1))
        metrics: dict[str, list[float]] = defaultdict(list)
        steps = 0
        for epoch in range(self.plan.epochs):
            for mini in self.plan.mini_batches(batch, self.spec.dist.dp_size, epoch, seed):
                steps += 1
                agg = self._global_counts(objective, mini)
                micros, real, _ = self._micro_batches(mini)  # sums over the micro-batches: their order is free
                micros = [objective.rows(m) for m in micros]
                loss_fn = functools.partial(_loss, objective, agg=agg, first_forward=first_forward)
                per_micro = self.backend.forward_backward(micros, outputs, loss_fn)[:real]
                if first_forward is not None:  # the entropy of the policy that sampled, as the old-log-prob pass would report it
                    total, tokens = self.backend.all_reduce_sum([sum(m.pop(k) for m in per_micro) for k in ENTROPY_SUMS])
                    metrics["entropy"].append(total / max(tokens, 1.0))
                summed = sorted({k for m in per_micro for k in m} & objective.summed)
                for k, v in zip(summed, self.backend.all_reduce_sum([sum(m.get(k, 0.0) for m in per_micro) for k in summed])):
                    metrics[k].append(v)
                for k in sorted({k for m in per_micro for k in m} - objective.summed):
                    values = [m[k] for m in per_micro if k in m]
                    metrics[k].append(sum(values) / len(values))
                for k, v in self.backend.optimizer_step().items():
                    metrics[k].append(v)
        metrics["lr"].append(self.backend.lr_step())
        return {f"{prefix}/{k}": sum(v) / len(v) for k, v in metrics.items()} | {f"{prefix}/optimizer_steps": float(steps)}

    def _first_forward(self, verb: str, batch: Batch) -> str | None:
        """The field this update fills from its own first forward (see :meth:`train`), or None
        when the objective declares none or the batch has it. Exact only with one optimizer
        step per batch, when that forward runs on the weights that would have computed it."""
        name = self.declared[verb]["first_forward"]
        if name is None or name in batch:
            return None
        samples = len(batch) * self.spec.dist.dp_size
        if not self.plan.one_update(samples):
            raise ValueError(
                f"{self.spec.role}.{verb} got no {name}: they can come from the update's own forward only with one "
                f"optimizer step per batch, but ppo_epochs={self.plan.epochs} and mini_batch_samples={self.plan.mini_batch_samples} "
                f"for {samples} samples; compute them first (the rl recipe runs log_prob when it updates more than once)"
            )
        return name

    def evaluate(self, verb: str, batch: Batch) -> dict[str, float]:
        """``verb``'s objective on ``batch`` without training (held-out figures): ``val/loss``,
        and ``val/<name>`` for each of the objective's other summed metrics (shares of the batch,
        e.g. the reward model's ``val/accuracy``)."""
        objective = self._objective(verb)
        agg = self._global_counts(objective, batch)
        micros, real, _ = self._micro_batches(batch)
        micros = [objective.rows(m) for m in micros]
        names = sorted(objective.summed - {"loss"})
        totals = [0.0] * (1 + len(names))
        with torch.no_grad():
            outs = self.backend.forward(micros, objective.outputs)
            for m, out in zip(micros[:real], outs[:real]):
                loss, metrics = objective.loss(m, out, agg)
                for i, value in enumerate([float(loss), *(metrics.get(k, 0.0) for k in names)]):
                    totals[i] += value
        return dict(zip(["val/loss", *(f"val/{k}" for k in names)], self.backend.all_reduce_sum(totals)))

    # -- weights and state -----------------------------------------------------------------------
    def export_weights(self, bucket_bytes: int = 64 << 20, all_ranks: bool = False, dtype: torch.dtype | None = None) -> Iterator[WeightBucket]:
        """Full weights in Hugging Face names, in buckets, cast to ``dtype`` if given (see
        ``Backend.export_weights``)."""
        return self.backend.export_weights(bucket_bytes, all_ranks, dtype=dtype)

    def __getattr__(self, verb: str) -> Any:
        """A verb the backend declares (``Backend.verbs``) is its method of that name."""
        backend = self.__dict__.get("backend")  # not yet built, or being unpickled: no verb of its own
        if backend is None or verb not in backend.verbs:
            raise AttributeError(f"{type(self).__name__} has no attribute or backend verb {verb!r}")
        return getattr(backend, verb)

    def weight_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Name -> full shape of every exported tensor in export order, without gathering (checked
        before a sync); None when the backend cannot tell."""
        return self.backend.weight_shapes()

    def full_module(self) -> torch.nn.Module | None:
        """The backend's whole causal LM for an engine in this process to generate from, or None
        (``Backend.full_module``)."""
        return self.backend.full_module()

    def offload(self) -> None:
        """Free accelerator memory for generation as the backend's options say (optimizer state,
        parameters); :meth:`onload` undoes it exactly."""
        self.backend.offload()

    def onload(self) -> None:
        self.backend.onload()

    def close(self) -> None:
        """End of the run: the backend leaves its process group."""
        self.backend.close()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the model's weights in memory (e.g. ref <- actor)."""
        self.backend.load_weights(weights)

    def save(self, path: Path) -> None:
        self.backend.save(Path(path))

    def load(self, path: Path) -> None:
        self.backend.load(Path(path))


# per-micro-batch sums behind the on-policy update's entropy metric
ENTROPY_SUMS = ("_entropy_sum", "_entropy_tokens")


def _loss(
    objective: Any, micro: Batch, outputs: dict[str, torch.Tensor], agg: Any, first_forward: str | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    if micro.meta.get(PADDING):
        # no weight, but a graph through every parameter, so the backward's collectives still run
        return sum(v.sum() for v in outputs.values()) * 0.0, {}
    extra: dict[str, float] = {}
    if first_forward is not None:
        micro[first_forward] = outputs["log_probs"].detach()
        mask = micro["response_mask"].to(outputs["entropy"].device)
        extra = dict(zip(ENTROPY_SUMS, (float((outputs["entropy"].detach() * mask).sum()), float(mask.sum()))))
        outputs = {k: outputs[k] for k in objective.outputs}
    loss, metrics = objective.loss(micro, outputs, agg)
    return loss, {**metrics, **extra}


def _right_pad(t: torch.Tensor, width: int | None) -> torch.Tensor:
    """A ``(batch, w, ...)`` output zero-padded on the right of dimension 1 to ``(batch, width, ...)``."""
    if width is None or t.dim() < 2 or t.shape[1] >= width:
        return t
    return pad_columns(t, 0, width - t.shape[1])


def build_worker(
    registry: Any,
    backend: str,
    role: str,
    model_path: str,
    role_options: Any = None,
    objectives: dict[str, str] | None = None,
    *,
    options: Any = None,
    dist: DistInfo | None = None,
    seed: int = 0,
    total_steps: int = 0,
    head: str = "lm",
) -> RoleWorker:
    """A built role worker in this process on the registered ``backend`` (its default options
    unless ``options`` is given; one rank unless ``dist`` says otherwise): for scripts, notebooks
    and tests that drive a role without a recipe."""
    entry = registry.get("backend", backend)
    if options is None and entry.options is not None:
        options = entry.options()
    objectives = dict(objectives or {})
    spec = WorkerSpec(role, model_path, entry.obj, options, role_options, objectives, dist or DistInfo(), registry, seed, total_steps, head)
    worker = RoleWorker(spec)
    worker.build()
    return worker
