"""Interface of a training backend (kind ``backend``): one role's model on one rank, and nothing else.

A backend builds a model from a Hugging Face folder and runs it: forward passes that return what
the objective asks for, backward, the optimizer step, checkpoints and weight export/load. It
holds no loss code: the role worker (``trellis.runtime.worker``) cuts batches into mini- and
micro-batches, asks the objective for each micro-batch's loss and hands it to the backend. So
FSDP, Megatron and a plain single-process backend share every algorithm.

A plugin registers a factory ``make_backend(spec: BackendSpec) -> Backend``. Its options
dataclass may define ``mesh(world_size) -> Mesh`` to lay its ranks out in tensor/pipeline
parallel groups (default: every rank data-parallel).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trellis.batch import Batch
from trellis.interfaces.dispatch import RANK0, Mesh, Route

WeightBucket = list[tuple[str, torch.Tensor]]


def weight_buckets(items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[WeightBucket]:
    """Consecutive ``(name, tensor)`` pairs in buckets of at most ``bucket_bytes`` (a larger tensor
    goes alone), taking ``items`` lazily: an exporter that gathers as it is read holds at most one
    bucket."""
    bucket: WeightBucket = []
    size = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


# A micro-batch's loss: ``loss_fn(micro, outputs) -> (loss, metrics)``; the loss is this
# micro-batch's share of the global mini-batch loss (a scalar with gradient).
LossFn = Callable[[Batch, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]

# What the built-in backends' forwards return (``outputs`` names), each for the micro-batch's samples:
#   log_probs      (batch, response_len)  log p(response token) at the sampling temperature
#   entropy        (batch, response_len)  entropy of the next-token distribution there
#   sum_sq_probs   (batch, response_len)  sum over the vocabulary of p^2 of that distribution
#   values         (batch, response_len)  the value head at the positions predicting each response token
#   label_log_probs (batch, seq_len - 1)  log p(input_ids[:, 1:]) (supervised losses)
#   scores         (batch,)               the value head at the last attended token (reward models)
#   top_log_probs  (batch, response_len, k)  the k largest log-probs of that distribution (k:
#                                         ``batch.meta["top_k"]``, 0 = the whole vocabulary), descending
#   top_ids        (batch, response_len, k)  their token ids
#   top_ids_log_probs (batch, response_len, k)  log-probs of the batch field ``top_ids``'s ids there
#                                         (a student's at its teacher's top ids: distillation losses)
#   base_log_probs (batch, response_len)  log_probs with the role's adapter off (the base model: a
#                                         reference without a second model); only a backend
#                                         training an adapter declares it
# A backend declares its own set in ``Backend.outputs`` (e.g. adding auxiliary outputs such as
# router logits); objectives and forwards asking for one it lacks are refused by name.
OUTPUTS = ("log_probs", "entropy", "sum_sq_probs", "values", "label_log_probs", "scores", "top_log_probs", "top_ids", "top_ids_log_probs")
# Batch fields the built-in backends' forwards read (``Backend.model_inputs``), and what a rollout
# engine reads of a prompt batch; log_probs/entropy/sum_sq_probs/values also read ``responses``.
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
# A sample's image inputs (a Python field, one dict per sample: ``pixel_values`` ``(patches, patch_dim)``,
# ``image_grid_thw`` ``(images, 3)``; empty for a text-only sample), as a vision-language model's image
# processor makes them; a micro-batch's are joined on dimension 0, in sample order. A backend or engine
# that takes images lists it in its ``model_inputs``; prompts with images are refused by the others.
IMAGE_INPUTS = "multi_modal_inputs"
# how many of a sample's images are its prompt's (the rest, environment turns returned), where a conversation's tools returned images
PROMPT_IMAGES = "prompt_images"


def join_images(*inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:data:`IMAGE_INPUTS` dicts joined into one (each input on dimension 0, in order; empty ones skipped)."""
    given = [x for x in inputs if x]
    return {name: torch.cat([x[name] for x in given]) for name in given[0]} if given else {}


def first_images(inputs: Mapping[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    """The first ``count`` images of an :data:`IMAGE_INPUTS` dict (an image's ``pixel_values`` are its
    grid's ``t x h x w`` rows)."""
    if not count:
        return {}
    grids = inputs["image_grid_thw"][:count]
    return {"pixel_values": inputs["pixel_values"][: int(grids.prod(-1).sum())], "image_grid_thw": grids}


def refuse_lost_images(batch: Batch, reads: tuple[str, ...], who: str) -> None:
    """Refuse ``batch`` when it holds images and ``who`` runs the model on it (``reads`` has
    ``input_ids``) without taking them (no :data:`IMAGE_INPUTS`): it would see the prompts' image
    placeholders without the images."""
    if IMAGE_INPUTS in batch and IMAGE_INPUTS not in reads and "input_ids" in reads and any(batch[IMAGE_INPUTS]):
        raise ValueError(
            f"{who} takes no images ({IMAGE_INPUTS} is not among its model_inputs), but these prompts have images; "
            "use one that takes them (backend fsdp, rollout hf) for a vision-language model"
        )


def backward_each(
    micros: list[Batch], forward: Callable[[Batch], dict[str, torch.Tensor]], loss_fn: LossFn, scale: float = 1.0
) -> list[dict[str, float]]:
    """The usual ``forward_backward``: for each micro-batch, ``forward(micro)`` (with gradient),
    ``loss_fn``, backward of ``loss * scale`` (a backend that averages gradients over ``W`` ranks
    passes ``scale=W``); returns each micro-batch's metrics."""
    metrics = []
    for micro in micros:
        loss, m = loss_fn(micro, forward(micro))
        (loss * scale).backward()
        metrics.append(m)
    return metrics


@dataclass
class DistInfo:
    """Where a worker sits: its rank in its role's world and the role's device mesh.

    init_method: how the ranks meet (torch.distributed's rendezvous URL): ``file://...`` when every
    rank is on one machine (no listening socket), else ``tcp://<rank 0's node>:<port>``; None:
    ``tcp://master_addr:master_port``. One rank needs none.
    """

    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    device: str = "auto"  # auto: cuda when available, else cpu
    mesh: Mesh | None = None  # None: every rank data-parallel
    init_method: str | None = None

    def __post_init__(self) -> None:
        if self.mesh is None:
            self.mesh = Mesh.data_parallel(self.world_size)
        if self.mesh.world_size != self.world_size:
            raise ValueError(f"mesh {self.mesh} has {self.mesh.world_size} ranks, the world has {self.world_size}")

    @property
    def dp_rank(self) -> int:
        return self.mesh.coords(self.rank)["dp"]

    @property
    def dp_size(self) -> int:
        return self.mesh.dp


@dataclass
class BackendSpec:
    """Everything a backend needs to build one role's model on one rank.

    role: the role's name (any: ``actor``, ``critic``, ``teacher``...), for messages and file names.
    trainable: the role trains (it has objectives): build an optimizer from ``optim``.
    head: ``lm`` (a causal LM: actor, ref, teacher) or ``value`` (one scalar per token: critic,
        reward model); a backend refuses a head it cannot build.
    options: the backend's options dataclass instance. optim: the role's ``OptimConfig`` section.
    total_steps: trainer steps of the run (for LR schedules).
    adapter: the role's ``AdapterConfig`` when it trains a LoRA adapter (``rank > 0``), else None;
        only a backend with ``adapters = True`` is given one (the role worker refuses the rest).
    """

    role: str
    model_path: str
    options: Any
    trainable: bool
    head: str = "lm"
    optim: Any = None
    dist: DistInfo = field(default_factory=DistInfo)
    seed: int = 0
    total_steps: int = 0
    adapter: Any = None


# the verb a backend that trains adapters serves: the adapter alone, gathered on rank 0's side
ADAPTER_VERBS: dict[str, Route] = {"export_adapter": Route(RANK0)}


class Backend(ABC):
    """One role's model on one rank. Tensors in and out are on CPU. ``build`` and ``forward`` are
    required; a backend that only scores or only serves a reference may leave the rest out.

    outputs: the forward outputs it can return (default :data:`OUTPUTS`).
    model_inputs: the ``Batch`` fields its forwards read (default :data:`MODEL_INPUTS`);
    controllers ship these (and what the objective reads) to the ranks, nothing more.
    adapters: it trains a LoRA adapter when ``BackendSpec.adapter`` is set (else such a role is refused).
    adapter_requires: ``(module, pip requirement)`` that adapters need, imported by the config check.
    verbs: the verbs it serves beyond the role worker's, each with how it is dealt over the ranks
    (``Route``): the role worker serves it by calling the backend's method of that name, in-process
    and through every controller (a LoRA backend declares :data:`ADAPTER_VERBS`)."""

    outputs: tuple[str, ...] = OUTPUTS
    model_inputs: tuple[str, ...] = MODEL_INPUTS
    adapters: bool = False
    adapter_requires: tuple[str, str] | None = None
    verbs: Mapping[str, Route] = {}

    @abstractmethod
    def build(self) -> None:
        """Join the process group, load the model (and optimizer and LR schedule if trainable)."""

    @abstractmethod
    def forward(self, micros: list[Batch], outputs: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
        """Forwards without gradient, one per micro-batch, each returning the named ``outputs``
        (among :attr:`outputs`). Every data-parallel rank gets the same number of micro-batches."""

    def forward_backward(self, micros: list[Batch], outputs: tuple[str, ...], loss_fn: LossFn) -> list[dict[str, float]]:
        """For each micro-batch: forward (with gradient), ``loss_fn(micro, outputs)``, backward,
        accumulating gradients. The gradients must be those of the loss *summed* over the
        data-parallel ranks (a backend that averages over ranks scales up). Returns each
        micro-batch's metrics."""
        raise NotImplementedError(f"backend {type(self).__name__} does not train")

    def optimizer_step(self) -> dict[str, float]:
        """Clip the gradients to ``optim.grad_clip`` (0: no clipping), step unless the norm is not
        finite, zero them. Returns ``grad_norm`` and ``skipped_steps`` (1.0 if skipped)."""
        raise NotImplementedError(f"backend {type(self).__name__} does not train")

    def lr_step(self) -> float:
        """Advance the LR schedule by one trainer step; returns the LR that was in use."""
        raise NotImplementedError(f"backend {type(self).__name__} does not train")

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Each value summed over the data-parallel ranks (unchanged on one rank)."""
        raise NotImplementedError(f"backend {type(self).__name__} does not reduce over ranks")

    def export_weights(self, bucket_bytes: int = 64 << 20, all_ranks: bool = False, dtype: torch.dtype | None = None) -> Iterator[WeightBucket]:
        """Full (unsharded) weights in Hugging Face names, in buckets of about ``bucket_bytes``.
        Every rank must call it (it gathers shards); rank 0 gets the weights, and with
        ``all_ranks`` every rank does. ``dtype``: the tensors cast to it (e.g. the rollout
        engine's); None: the weights' own. A sharded backend should gather one tensor at a time
        as the buckets are consumed, so no rank ever holds the whole model."""
        raise NotImplementedError(f"backend {type(self).__name__} does not export weights")

    def export_adapter(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The LoRA adapter alone, as PEFT saves one: ``adapter_config.json``'s fields and the
        tensors under PEFT's names (``base_model.model.<module>.lora_A.weight``), whole, on CPU,
        on every rank (every rank must call it: shards are gathered). Only for a role that trains an
        adapter (``BackendSpec.adapter``); served as a verb by backends that declare :data:`ADAPTER_VERBS`."""
        raise NotImplementedError(f"backend {type(self).__name__} trains no adapter to export")

    def weight_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Name -> full shape of each tensor :meth:`export_weights` yields, in the same order,
        without gathering anything: the manifest a rollout engine checks before a streamed weight
        sync. Default None (unknown): the engine then reads the whole update before loading it."""
        return None

    def full_module(self) -> torch.nn.Module | None:
        """The causal LM itself, when this rank holds every weight whole, in the dtype it computes
        in, and keeps them in place while an engine generates: a rollout engine in the same
        process may then generate from it (no copy, no weight sync; see
        ``RolloutEngine.adopt_module``). Default None (sharded, or no such module)."""
        return None

    def offload(self) -> None:
        """A rollout engine is about to generate on this device: move whatever the backend's
        options say (optimizer state, parameters) to host memory. Default: nothing."""

    def onload(self) -> None:
        """Bring back what :meth:`offload` moved, unchanged. Default: nothing."""

    def close(self) -> None:
        """Release what ``build`` acquired beyond memory (e.g. leave the process group) at the end
        of a run. Default: nothing."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the model's weights with these full tensors (Hugging Face names), in memory;
        every rank gets every tensor and keeps its own shard."""
        raise NotImplementedError(f"backend {type(self).__name__} does not load weights in memory")

    def save(self, path: Path) -> None:
        """Write this rank's model/optimizer/schedule/RNG state under ``path``; a role with an
        adapter also writes its base model's ``base_fingerprint`` (rank 0, to
        ``ADAPTER_BASE_FILE``), which a resume or export checks before building anything."""
        raise NotImplementedError(f"backend {type(self).__name__} cannot save")

    def load(self, path: Path) -> None:
        """Restore what ``save`` wrote."""
        raise NotImplementedError(f"backend {type(self).__name__} cannot load")
