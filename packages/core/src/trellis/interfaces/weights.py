"""Checks of an in-memory weight update, done before anything reaches a rollout engine.

A reload that fails inside an engine (vLLM, SGLang) can leave its model half-loaded, and the next
generation kills it. So every name, shape, dtype and fused-module group is checked here first,
against the names and shapes the engine loaded at start-up (the checkpoint's), and tied embeddings
are completed. An update comes either as a whole (a list: materialised, then checked) or as a
stream with a manifest (the exporter's name -> shape, :func:`prepare_update`): the manifest is
checked before any tensor is read, then each tensor is verified as it arrives and handed on, so
the engine side never holds more than the tensor in flight. Plain torch and safetensors: no
engine is imported.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

# Engines fuse these Hugging Face projections into one module (vLLM, SGLang); a fused module must be reloaded
# whole or not at all. Used when the engine cannot ask the model class for its own mapping.
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


Entry = tuple[str, tuple[int, ...]]  # a manifest's (name, full shape)
T = TypeVar("T")


class WeightSyncError(ValueError):
    """A refused weight update. Refused by the checks before loading: no tensor reached the engine,
    its weights are unchanged. Refused mid-stream (a tensor disagrees with its manifest entry: the
    exporter's bug): the engine holds part of the update and needs a full sync before generating."""


def checkpoint_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the model folder's safetensors files (read from headers,
    no data loaded). Falls back to a meta-device model built from ``config.json``."""
    folder = Path(model_path)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            shapes.update(_safetensors_header(f))
        return shapes
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def tied_pairs(hf_config) -> dict[str, str]:
    """Output-head name -> input-embedding name for a model with tied embeddings, else {}."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if not getattr(text, "tie_word_embeddings", False):
        return {}
    keys = None
    for arch in getattr(hf_config, "architectures", None) or []:
        import transformers

        cls = getattr(transformers, arch, None)
        keys = getattr(cls, "_tied_weights_keys", None)
        if keys:
            break
    if isinstance(keys, Mapping) and keys:
        return dict(keys)
    return {"lm_head.weight": "model.embed_tokens.weight"}


def engine_weights(model_path: str | Path, hf_config) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """What an engine built from ``model_path`` holds, for :func:`check_update`: name -> shape of
    every checkpoint tensor plus the output head of a tied pair, and the tied pairs (:func:`tied_pairs`)."""
    shapes = checkpoint_shapes(model_path)
    tied = tied_pairs(hf_config)
    for head, embed in tied.items():
        if embed in shapes:
            shapes.setdefault(head, shapes[embed])
    return shapes, tied


Renamer = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def checkpoint_names(hf_config) -> Renamer | None:
    """How a trainer's tensor, named and shaped as ``transformers`` holds it in memory, becomes the
    checkpoint tensors an engine built from the folder loads: ``transformers``' own reversal of its
    load-time conversions (``revert_weight_conversion``: e.g. a mixture-of-experts layer's fused
    ``experts.gate_up_proj`` ``(experts, 2 * width, hidden)`` back to each expert's ``gate_proj`` and
    ``up_proj``); None for a model whose names are its checkpoint's (every dense model here)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion

    auto = AutoModelForImageTextToText if getattr(hf_config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(hf_config)
    state = model.state_dict()
    if revert_weight_conversion(model, dict(state)).keys() == state.keys():
        return None
    return lambda name, tensor: revert_weight_conversion(model, {name: tensor}).items()


def _renamed(weights: Iterable[tuple[str, T]], rename: Renamer, meta: bool = False) -> Iterator[tuple[str, T]]:
    for name, value in weights:
        tensor = torch.empty(tuple(value), device="meta") if meta else value
        for new, out in rename(name, tensor):
            yield new, (tuple(out.shape) if meta else out)


def group_of(name: str, packed: Mapping[str, list[str]]) -> str:
    """The engine module a checkpoint tensor loads into: its parent module, with the shard names of
    fused modules (``q_proj`` -> ``qkv_proj``) replaced."""
    module = name.rsplit(".", 1)[0]
    parent, _, leaf = module.rpartition(".")
    for fused, shards in packed.items():
        if leaf in shards:
            return f"{parent}.{fused}" if parent else fused
    return module


def check_manifest(
    entries: Iterable[tuple[str, Sequence[int]]],
    expected: Mapping[str, tuple[int, ...]],
    packed: Mapping[str, list[str]] = DEFAULT_PACKED,
) -> None:
    """Check an update's ``(name, shape)`` entries before any tensor loads. Raises
    :class:`WeightSyncError` (a ``ValueError``) for a repeated name, an unknown name (with the closest
    known names), a wrong shape, or a fused module given only in part (the engine would load the
    missing shards as garbage)."""
    seen: set[str] = set()
    for name, shape in entries:
        if name in seen:
            raise WeightSyncError(f"rollout weight update: {name!r} is given twice")
        seen.add(name)
        if name not in expected:
            close = difflib.get_close_matches(name, list(expected), n=3, cutoff=0.6)
            raise WeightSyncError(f"rollout weight update: unknown parameter {name!r}; the engine's closest names: {close}")
        if tuple(shape) != tuple(expected[name]):
            raise WeightSyncError(f"rollout weight update: {name!r} has shape {tuple(shape)}, the engine expects {tuple(expected[name])}")
    members: dict[str, list[str]] = {}
    for name in expected:
        members.setdefault(group_of(name, packed), []).append(name)
    for group in {group_of(name, packed) for name in seen}:
        missing = [n for n in members[group] if n not in seen]
        if missing:
            raise WeightSyncError(
                f"rollout weight update: module {group!r} is updated only in part; missing {missing}. "
                "the engine loads fused modules whole: send all of their tensors together"
            )


def _check_tensor(name: str, tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise WeightSyncError(f"rollout weight update: {name!r} is a {type(tensor).__name__}, not a tensor")
    if not tensor.is_floating_point():
        raise WeightSyncError(f"rollout weight update: {name!r} has dtype {tensor.dtype}; the engine's weights are floating point")


def check_update(
    weights: Iterable[tuple[str, torch.Tensor]],
    expected: Mapping[str, tuple[int, ...]],
    packed: Mapping[str, list[str]] = DEFAULT_PACKED,
) -> list[tuple[str, torch.Tensor]]:
    """Validate a whole update; return it as a list. Raises :class:`WeightSyncError` for a
    non-tensor, a non-floating-point tensor, or what :func:`check_manifest` refuses."""
    items = list(weights)
    for name, tensor in items:
        _check_tensor(name, tensor)
    check_manifest(((name, tensor.shape) for name, tensor in items), expected, packed)
    return items


def complete_tied(weights: Iterable[tuple[str, T]], tied: Mapping[str, str], names: Collection[str]) -> Iterator[tuple[str, T]]:
    """Each item, followed by the missing half of its tied pair: an engine (vLLM) keeps its own copy
    of a tied output head on some backends (the CPU one repacks it), so the head must be sent along
    with the embedding. ``names``: every name of the update (the items may be a stream); items are
    ``(name, tensor)`` or a manifest's ``(name, shape)``."""
    partner = {}
    for head, embed in tied.items():
        if embed in names and head not in names:
            partner[embed] = head
        elif head in names and embed not in names:
            partner[head] = embed
    for name, value in weights:
        yield name, value
        if name in partner:
            yield partner[name], value


def verified(weights: Iterable[tuple[str, torch.Tensor]], manifest: Sequence[Entry]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a streamed update, each checked against its manifest entry (same name in the
    same place, same shape, floating point) as it arrives. A disagreement is the exporter's bug
    (its ``export_weights`` and ``weight_shapes`` differ): :class:`WeightSyncError` naming it."""
    bug = "the exporter's weights and its manifest (weight_shapes) disagree: a backend bug; the engine holds part of the update"
    count = 0
    for count, (name, tensor) in enumerate(weights, 1):
        if count > len(manifest):
            raise WeightSyncError(f"rollout weight update: tensor {count} {name!r} is past the manifest's {len(manifest)}; {bug}")
        want, shape = manifest[count - 1]
        if name != want:
            raise WeightSyncError(f"rollout weight update: tensor {count} is {name!r}, the manifest has {want!r} there; {bug}")
        _check_tensor(name, tensor)
        if tuple(tensor.shape) != shape:
            raise WeightSyncError(f"rollout weight update: {name!r} arrived with shape {tuple(tensor.shape)}, the manifest says {shape}; {bug}")
        yield name, tensor
    if count < len(manifest):
        missing = manifest[count][0]
        raise WeightSyncError(f"rollout weight update: the stream ended after {count} of {len(manifest)} tensors, before {missing!r}; {bug}")


@dataclass
class Update:
    """A checked update: ``manifest`` lists each tensor's ``(name, shape)`` in arrival order, tied
    halves included; ``tensors`` yields them (a list, or a verifying stream read once)."""

    manifest: list[Entry]
    tensors: Iterable[tuple[str, torch.Tensor]]


def prepare_update(
    weights: Iterable[tuple[str, torch.Tensor]],
    expected: Mapping[str, tuple[int, ...]],
    tied: Mapping[str, str],
    packed: Mapping[str, list[str]] = DEFAULT_PACKED,
    shapes: Mapping[str, Sequence[int]] | None = None,
    rename: Renamer | None = None,
) -> Update:
    """What an engine loads, checked (see :func:`engine_weights` for ``expected`` and ``tied``).
    ``shapes`` None: ``weights`` is read whole and checked (:func:`check_update`). Else ``shapes``
    is the manifest (name -> full shape, in the order ``weights`` will yield them): it is checked
    now, before anything is read; ``weights`` is consumed lazily as the engine reads
    ``Update.tensors``, each tensor verified against it (:func:`verified`). ``rename``: the update
    comes in the trainer's names, which :func:`checkpoint_names` turns into the checkpoint's first."""
    if rename is not None:
        weights = _renamed(weights, rename)
        shapes = None if shapes is None else dict(_renamed(shapes.items(), rename, meta=True))
    if shapes is None:
        items = list(weights)
        items = check_update(complete_tied(items, tied, [name for name, _ in items]), expected, packed)
        return Update([(name, tuple(t.shape)) for name, t in items], items)
    manifest = [(name, tuple(shape)) for name, shape in complete_tied(shapes.items(), tied, shapes)]
    check_manifest(manifest, expected, packed)
    return Update(manifest, verified(complete_tied(weights, tied, shapes), manifest))
