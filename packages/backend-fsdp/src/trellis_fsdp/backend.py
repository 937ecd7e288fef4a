"""FSDP2 backend: any Hugging Face model fully sharded per decoder layer, for every role.

One rank with nothing to cast (the weights' dtype throughout) is a plain module: FSDP2 would
only add a copy of every weight per forward and DTensor dispatch to every optimizer op, and a
rollout engine in the same process can generate from the module itself (:meth:`full_module`).

Only the model: build, forwards, backward, optimizer step, checkpoints and weights. Losses come
from the objective layer through ``trellis.runtime.worker.RoleWorker``.

LoRA (``BackendSpec.adapter``): PEFT's adapter layers in the plain model (:mod:`trellis_fsdp.lora`);
only the adapter trains and is checkpointed, exports merge it into plain Hugging Face names, and
the ``base_log_probs`` output runs the model with the adapter off (a reference without a second
model).

Memory: the model is built on the meta device and sharded before any weight exists; rank 0 alone
reads the folder and broadcasts one tensor at a time into the shards. Weight export gathers one
parameter at a time (cast to the export dtype first). Optimizer state and parameters can leave
the accelerator while a rollout engine generates (``offload`` / ``onload``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from trellis import Batch, choice, ranged
from trellis.kit.backend import (
    ADAPTER_BASE_FILE,
    ADAPTER_VERBS,
    IMAGE_INPUTS,
    IMPLEMENTATIONS,
    MODEL_INPUTS,
    MOE_OUTPUTS,
    OUTPUTS,
    ROUTED_EXPERTS,
    Backend,
    BackendSpec,
    LossFn,
    WeightBucket,
    backward_each,
    base_fingerprint,
    clipped_step,
    device_for,
    empty_hf_model,
    forward_outputs,
    get_rng_state,
    keep_buffers,
    leave_process_group,
    load_hf_model,
    make_optimizer,
    schedule_step,
    set_rng_state,
    vision_tower,
    weight_buckets,
)
from trellis_fsdp.distributed import all_reduce_sum, ensure_process_group
from trellis_fsdp.lora import (
    ADAPTER,
    adapted_layers,
    adapter_off,
    add_adapter,
    hf_name,
    is_adapter,
    merged,
    saved_config,
    saved_name,
)
from trellis_fsdp.offload import HostCopy
from trellis_fsdp.shared_prompts import shared_outputs

log = logging.getLogger("trellis")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# on CUDA: fp32 master weights, bf16 compute, fp32 gradient reduction; on CPU: the weights' dtype throughout
AUTO_PRECISION = {"cuda": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}, "cpu": {"param_dtype": None, "reduce_dtype": None}}


@dataclass
class FSDPOptions:
    """dtype: the master weights' dtype (what the optimizer updates; keep float32).
    param_dtype: the compute dtype FSDP2 casts the gathered weights to (``auto``: bfloat16 on CUDA,
    the weights' dtype on CPU; None: the weights' dtype). reduce_dtype: the dtype gradients are
    reduced in over ranks (``auto``: float32 on CUDA; None: FSDP2's default, which is
    ``param_dtype``, not the weights' dtype). entropy_chunk_size: positions per chunk when
    log-probs, entropies and ``sum p^2`` are computed from logits (bounds the float32
    ``(chunk, vocab)`` temporaries; each chunk is recomputed in the backward). padding_free: run
    each micro-batch as one packed sequence without padding (attention over a block-diagonal
    mask; pays off with varlen attention kernels, costs ``(tokens, tokens)`` masks with sdpa).
    share_prompts: ``auto``: in the padded layout, a micro-batch whose samples share prompts (GRPO's
    ``n`` samples of one) runs each prompt once, its responses after it in one row, each attending
    to the prompt and to itself (the same log-probs and gradients, less work: half the update at
    8-token responses) wherever that computes fewer multiply-adds than padding every sample to the
    longest (a dense text model under sdpa; see ``trellis_fsdp.shared_prompts``); ``off``: never.
    optimizer: AdamW kernels (``auto``: fused on CUDA, foreach elsewhere). offload_optimizer /
    offload_params: while a rollout engine generates, keep this role's optimizer state /
    parameter shards in host memory (``offload`` / ``onload``). freeze_vision_tower: a
    vision-language model's vision tower keeps its weights (no gradient, not in the optimizer; a
    LoRA adapter leaves it out too), as verl's ``freeze_vision_tower``."""

    dtype: str = choice("float32", tuple(DTYPES))
    param_dtype: str | None = choice("auto", (*DTYPES, "auto"))
    reduce_dtype: str | None = choice("auto", (*DTYPES, "auto"))
    activation_checkpointing: bool = False
    entropy_chunk_size: int | None = ranged(2048, ge=1)
    padding_free: bool = False
    share_prompts: str = choice("auto", ("auto", "off"))
    optimizer: str = choice("auto", IMPLEMENTATIONS)
    offload_optimizer: bool = False
    offload_params: bool = False
    freeze_vision_tower: bool = False

    def activation_dtype(self, device_type: str) -> str:
        """The dtype the forward computes in on ``device_type`` (``cuda`` or ``cpu``): ``param_dtype``,
        ``auto`` resolved, else ``dtype`` (what the activation-memory check counts in)."""
        compute = AUTO_PRECISION[device_type]["param_dtype"] if self.param_dtype == "auto" else self.param_dtype
        return compute or self.dtype


class FSDPBackend(Backend):
    """One role's model on one rank, fully sharded over the data-parallel ranks (a plain module
    on a single rank that casts nothing)."""

    adapters = True
    adapter_requires = ("peft", "trellis-backend-fsdp[lora]")
    verbs = ADAPTER_VERBS
    model_inputs = (*MODEL_INPUTS, IMAGE_INPUTS, ROUTED_EXPERTS)  # a vision-language model's images, an MoE policy's recorded routes

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.adapter = spec.adapter
        self.base: dict[str, str] | None = None  # the base model's fingerprint, once an adapter checkpoint needs it
        if self.adapter is not None and spec.head != "lm":
            raise ValueError(f"config key '{spec.role}.adapter.rank'={self.adapter.rank}: adapters are for the lm head only; set it to 0")
        self.outputs = (*OUTPUTS, *MOE_OUTPUTS) + ("base_log_probs",) * (self.adapter is not None)
        self.opts: FSDPOptions = spec.options if spec.options is not None else FSDPOptions()
        self.device = device_for(spec.dist)
        self.offloaded: list[HostCopy] = []

    # -- set-up -----------------------------------------------------------------------------
    def _precision(self) -> tuple[torch.dtype, torch.dtype | None, torch.dtype | None]:
        """(weights, compute, reduction) dtypes after ``auto`` is resolved for this device."""
        auto = AUTO_PRECISION["cuda" if self.device.type == "cuda" else "cpu"]
        names = {n: getattr(self.opts, n) for n in ("dtype", "param_dtype", "reduce_dtype")}
        for name, value in names.items():
            valid = (*DTYPES, "auto", None) if name != "dtype" else tuple(DTYPES)
            if value not in valid:
                raise ValueError(f"backend.{name}={value!r} is not a dtype; valid: {', '.join(map(str, valid))}")
            if value == "auto":
                names[name] = auto[name]
        if self.opts.optimizer not in IMPLEMENTATIONS:
            raise ValueError(f"backend.optimizer={self.opts.optimizer!r} is unknown; valid: {', '.join(IMPLEMENTATIONS)}")
        if self.spec.trainable and names["dtype"] != "float32":
            log.warning(
                "backend.dtype=%s: %s's master weights and optimizer state are %s, so small updates round away; "
                "keep dtype=float32 and set param_dtype=bfloat16 for low-precision compute",
                names["dtype"],
                self.spec.role,
                names["dtype"],
            )
        return tuple(DTYPES[v] if v else None for v in names.values())

    def build(self) -> None:
        dtype, param_dtype, reduce_dtype = self._precision()
        self.mesh = ensure_process_group(self.spec.dist)
        torch.manual_seed(self.spec.seed)
        # no weights yet: shard the meta-device model, then give each rank room for its shards only
        empty = empty_hf_model(self.spec.model_path, self.spec.head, dtype)
        self.frozen = self._frozen_tower(empty)
        self.model = self._with_adapter(empty)
        self.layers = adapted_layers(self.model) if self.adapter is not None else {}
        self.merges = {f"{name}.weight": layer for name, layer in self.layers.items()}  # exported weight -> its LoRA layer
        if self.opts.activation_checkpointing and self.spec.trainable:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # one rank and no cast: FSDP2 would shard nothing and cast nothing
        self.sharded = self.spec.dist.world_size > 1 or param_dtype not in (None, dtype)
        if self.sharded:
            self._shard(MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
        restore_buffers = keep_buffers(self.model)  # rotary inv_freq...: in no checkpoint
        self.model.to_empty(device=self.device)
        if not self.sharded:
            self.model.tie_weights()  # to_empty made a parameter per module: share a tied head's again
        restore_buffers()
        # rank 0 reads the folder; every tensor is broadcast and each rank keeps its shard
        # (its adapter initialised there too, from the seed, and broadcast with the rest)
        full = self._with_adapter(load_hf_model(self.spec.model_path, self.spec.head, dtype)).state_dict() if dist.get_rank() == 0 else {}
        self._set_full_state(full, broadcast=True)
        del full
        if self.opts.freeze_vision_tower:
            for name, param in self.model.named_parameters():
                param.requires_grad_(param.requires_grad and not name.startswith(self.frozen + "."))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self.scheduler = None
        if self.spec.trainable:
            self._report_trainable()
            self.optimizer, self.scheduler = make_optimizer(self.params, self.spec.optim, self.spec.total_steps, self.opts.optimizer)
            self.model.train()
        else:
            self.model.eval()

    def _with_adapter(self, model: torch.nn.Module) -> torch.nn.Module:
        return model if self.adapter is None else add_adapter(model, self.adapter, self.spec.role, self.spec.seed, self.frozen)

    def _frozen_tower(self, model: torch.nn.Module) -> str | None:
        """The vision tower ``freeze_vision_tower`` freezes (None when off); refused for a model without one."""
        if not self.opts.freeze_vision_tower:
            return None
        tower = vision_tower(model)
        if tower is None:
            raise ValueError(
                f"config key 'backend.freeze_vision_tower' is true, but {self.spec.model_path!r} "
                f"({type(model).__name__}) has no vision tower; set it to false"
            )
        return tower

    def _report_trainable(self) -> None:
        """Log trainable / total parameters; refuse a trained role where nothing would train."""
        total = sum(p.numel() for p in self.model.parameters())
        trained = sum(p.numel() for p in self.params)
        what = f"a LoRA adapter of rank {self.adapter.rank} on {len(self.layers)} layers" if self.adapter is not None else "full weights"
        if trained == 0:
            raise ValueError(f"role {self.spec.role!r} would train no parameter ({what}); check {self.spec.role}.adapter.target_modules")
        log.info("%s: %d of %d parameters train (%.2f%%): %s", self.spec.role, trained, total, 100 * trained / total, what)

    def _shard(self, mp: MixedPrecisionPolicy) -> None:
        # Decoder layers are the classes a model declares it must not split across devices.
        layer_classes = tuple(getattr(self.model, "_no_split_modules", None) or ())
        for module in self.model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=self.mesh, mp_policy=mp)
        fully_shard(self.model, mesh=self.mesh, mp_policy=mp)

    def _reshard(self) -> None:
        """Back to the sharded layout, which a no_grad forward leaves behind (FSDP2 keeps the root
        unsharded after it) and state-dict calls need."""
        if self.sharded:
            self.model.reshard()

    def _set_full_state(self, state: dict[str, torch.Tensor], broadcast: bool = False) -> None:
        """Full tensors into this rank's shards (``broadcast``: rank 0's ``state``, the others pass {})."""
        self._reshard()
        if not broadcast and self.spec.head == "lm" and getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: the embedding is the head
        options = StateDictOptions(full_state_dict=True, strict=not broadcast or dist.get_rank() == 0, broadcast_from_rank0=broadcast)
        set_model_state_dict(self.model, state, options=options)

    # -- forward and backward -------------------------------------------------------------------
    def _outputs(self, micro: Batch, outputs: tuple[str, ...]) -> dict[str, torch.Tensor]:
        def run(names: tuple[str, ...]) -> dict[str, torch.Tensor]:
            chunk = self.opts.entropy_chunk_size
            if self.opts.share_prompts == "auto" and not self.opts.padding_free and self.spec.head == "lm":
                shared = shared_outputs(self.model, micro, names, chunk)
                if shared is not None:
                    return shared
            return forward_outputs(self.model, micro, names, self.spec.head, chunk, self.opts.padding_free)

        if "base_log_probs" not in outputs:
            return run(outputs)
        with adapter_off(self.layers):
            base = run(("log_probs",))["log_probs"]
        rest = tuple(o for o in outputs if o != "base_log_probs")
        return {**(run(rest) if rest else {}), "base_log_probs": base}

    def forward(self, micros: list[Batch], outputs: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
        training = self.model.training
        self.model.eval()  # no dropout (an adapter's) in forwards without gradient
        with torch.no_grad():
            results = [{k: v.cpu() for k, v in self._outputs(m, outputs).items()} for m in micros]
        self.model.train(training)
        self._reshard()
        return results

    def forward_backward(self, micros: list[Batch], outputs: tuple[str, ...], loss_fn: LossFn) -> list[dict[str, float]]:
        # FSDP averages gradients over ranks; the loss is this rank's share of the global
        # mini-batch, so scale by the world size to get the gradient of the sum.
        return backward_each(micros, lambda micro: self._outputs(micro, outputs), loss_fn, self.spec.dist.world_size)

    def optimizer_step(self) -> dict[str, float]:
        return clipped_step(self.params, self.optimizer, self.spec.optim.grad_clip)

    def lr_step(self) -> float:
        return schedule_step(self.scheduler)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return all_reduce_sum(values, self.device)

    # -- weights ---------------------------------------------------------------------------------------
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> full shape of every exported tensor, read from the shards (nothing gathered)."""
        return {name: tuple(t.shape) for name, t in self._state()}

    def _state(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Hugging Face names (an adapter's base weights under their plain names, the adapter
        itself left out: it is merged on export); DTensors when sharded."""
        self._reshard()
        state = self.model.state_dict(keep_vars=True)
        return [(hf_name(n), t) for n, t in state.items() if not is_adapter(n)] if self.layers else state.items()

    def _full_tensors(self, dtype: torch.dtype | None, to_cpu: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor gathered alone, cast to ``dtype`` shard-side first (a bf16 export moves and
        holds half the bytes); the previous one is the caller's to drop. A weight with a LoRA
        adapter is gathered in its own dtype with the adapter, merged, then cast."""
        for name, tensor in self._state():
            cast = dtype if dtype is not None and tensor.is_floating_point() else None
            layer = self.merges.get(name)
            if layer is None:
                tensor = _full(tensor, cast)
            else:
                a, b = (_full(m[ADAPTER].weight, None) for m in (layer.lora_A, layer.lora_B))
                tensor = merged(layer, _full(tensor, None), a, b)
                tensor = tensor if cast is None else tensor.to(cast)
            yield name, tensor.cpu() if to_cpu else tensor

    def export_weights(self, bucket_bytes: int = 64 << 20, all_ranks: bool = False, dtype: torch.dtype | None = None) -> Iterator[WeightBucket]:
        """Full tensors under Hugging Face names, in buckets of about ``bucket_bytes``, gathered one
        tensor at a time as the buckets are consumed (a rank never holds the full model). Every
        rank takes part in each gather; ranks other than 0 run theirs at once and get an empty
        iterator unless ``all_ranks`` (then every rank gets the tensors on its device, else on
        CPU). ``dtype``: cast before the gather (e.g. the rollout engine's bfloat16)."""
        stream = self._full_tensors(dtype, to_cpu=not all_ranks)
        if dist.get_rank() != 0 and not all_ranks:
            for _ in stream:  # join rank 0's gathers, keep nothing
                pass
            return iter(())
        return weight_buckets(stream, bucket_bytes)

    def export_adapter(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The adapter alone under PEFT's saved names, gathered whole on CPU on every rank (it is
        small, and each rank's rollout engine takes it)."""
        if self.adapter is None:
            raise ValueError(f"role {self.spec.role!r} trains full weights: there is no adapter to export alone; export the merged model")
        self._reshard()
        tensors = {saved_name(n): _full(t, None).cpu() for n, t in self.model.state_dict(keep_vars=True).items() if is_adapter(n)}
        return saved_config(self.adapter, self.layers, self.spec.model_path, self.frozen), tensors

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full tensors (every rank gets all of them) into this rank's shards."""
        if self.adapter is not None:
            raise ValueError(f"role {self.spec.role!r} trains a LoRA adapter: full weights cannot replace its base weights and adapter")
        self._set_full_state(dict(weights))

    def full_module(self) -> torch.nn.Module | None:
        """The model itself when this rank holds every weight whole in the dtype it computes in
        (one rank, nothing cast) and keeps them in place while an engine generates (no
        ``offload_params``); None otherwise."""
        return self.model if not self.sharded and self.spec.head == "lm" and not self.opts.offload_params else None

    # -- memory while generating -----------------------------------------------------------------------
    def offload(self) -> None:
        """Move what ``offload_optimizer`` / ``offload_params`` name to host memory (a rollout
        engine is about to generate); :meth:`onload` brings it back bit for bit."""
        if self.offloaded:
            return
        tensors: list[torch.Tensor] = []
        if self.opts.offload_params:
            self._reshard()
            tensors += list(self.model.parameters())
        if self.opts.offload_optimizer and self.optimizer is not None:
            tensors += [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        self.offloaded = HostCopy.of(tensors)

    def onload(self) -> None:
        for copy in self.offloaded:
            copy.restore()
        if self.offloaded and self.device.type == "cuda":
            torch.cuda.synchronize()  # the host copies may be freed once the bytes are back
        self.offloaded = []

    # -- checkpoints ------------------------------------------------------------------------------------
    def _state_options(self) -> StateDictOptions:
        """With an adapter the frozen base weights stay out of checkpoints (the run's
        ``model.path`` holds them): the adapter and its optimizer state only."""
        adapter = self.adapter is not None
        return StateDictOptions(ignore_frozen_params=adapter, strict=not adapter)

    def _sharded_state(self) -> dict:
        self._reshard()
        if self.optimizer is None:
            model, optim = get_model_state_dict(self.model, options=self._state_options()), None
        else:
            model, optim = get_state_dict(self.model, self.optimizer, options=self._state_options())
        if self.adapter is not None:  # ignore_frozen_params keeps a tied head's second name (lm_head.weight)
            model = {k: v for k, v in model.items() if is_adapter(k)}
        return {"model": model} if optim is None else {"model": model, "optim": optim}

    def save(self, path: Path) -> None:
        """Model (with an adapter: the adapter alone) and optimizer through
        ``torch.distributed.checkpoint`` (each rank writes its own shard into ``path``), plus
        ``rank<r>.pt``: this rank's LR scheduler and RNG states."""
        path = Path(path)
        dcp.save(self._sharded_state(), checkpoint_id=path)
        extra = {"scheduler": self.scheduler.state_dict() if self.scheduler else None, "rng": get_rng_state()}
        torch.save(extra, path / f"rank{self.spec.dist.rank}.pt")
        if self.adapter is not None and self.spec.dist.rank == 0:  # the adapter alone means nothing without its base
            self.base = self.base or base_fingerprint(self.spec.model_path)
            (path / ADAPTER_BASE_FILE).write_text(json.dumps(self.base) + "\n")

    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote (any number of ranks may have written it: DCP reshards).
        A role without an optimizer (``ref``) loads the model weights alone."""
        path = Path(path)
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=path)
        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"], options=self._state_options())
        else:
            options = self._state_options()
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
        extra_file = path / f"rank{self.spec.dist.rank}.pt"
        if extra_file.is_file():
            extra = torch.load(extra_file, weights_only=True)
            if self.scheduler is not None and extra["scheduler"] is not None:
                self.scheduler.load_state_dict(extra["scheduler"])
            set_rng_state(extra["rng"])

    def close(self) -> None:
        """Leave the process group (the first role of a process to close ends it for all; a
        process that never calls it leaves at exit)."""
        leave_process_group()


# bytes one gather collective moves (over all ranks): bounds the temporaries beyond the output
GATHER_BYTES = 2 << 20
# torch 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _full(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The whole of a (sharded or plain) tensor, in ``dtype`` (None: its own), without gradient."""
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        return _gather(tensor, dtype)
    return tensor if dtype is None else tensor.to(dtype)


def _gather(tensor: DTensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The full tensor of a DTensor, in ``dtype``. FSDP2's dim-0 shards on a 1-D mesh (cut as
    ``torch.chunk`` cuts) are cast and gathered a piece at a time straight into the output, so
    the output plus about ``GATHER_BYTES`` is all the memory it takes (gloo's collectives copy
    their buffers once more); other layouts go through ``full_tensor``."""
    mesh, dtype = tensor.device_mesh, dtype or tensor.dtype
    if mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),) or tensor.dim() == 0:
        return tensor.to(dtype).full_tensor()
    world = mesh.size()
    local = tensor.to_local().reshape(-1)
    per_rank = -(-tensor.shape[0] // world) * (tensor.numel() // max(tensor.shape[0], 1))  # ceil(rows / world) rows
    out = torch.empty(world, per_rank, dtype=dtype, device=local.device)
    step = max(1, GATHER_BYTES // (world * out.element_size()))
    for start in range(0, per_rank, step):
        size = min(step, per_rank - start)
        piece = local[start : start + size].to(dtype)
        if piece.numel() < size:  # the last ranks' shards are shorter (or empty)
            piece = torch.nn.functional.pad(piece, (0, size - piece.numel()))
        buffer = out.new_empty(world * size)
        _all_gather(buffer, piece, group=mesh.get_group())
        out[:, start : start + size] = buffer.view(world, size)
    return out.view(-1)[: tensor.numel()].view(tensor.shape)
