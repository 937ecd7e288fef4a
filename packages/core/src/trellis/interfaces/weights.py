"""Checks of an in-memory weight update, done before anything reaches a rollout engine.

A reload that fails inside an engine (vLLM, SGLang) can leave its model half-loaded, and the next
generation kills it. So every name, shape, dtype and fused-module group is checked here first,
against the names and shapes the engine loaded at start-up (the checkpoint's), and tied embeddings
are completed. Plain torch and safetensors: no engine is imported.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

# Engines fuse these Hugging Face projections into one module (vLLM, SGLang); a fused module must be reloaded
# whole or not at all. Used when the engine cannot ask the model class for its own mapping.
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class WeightSyncError(ValueError):
    """A weight update refused before any tensor reached the engine; its weights are unchanged."""


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


def complete_tied(weights: list[tuple[str, torch.Tensor]], tied: Mapping[str, str]) -> list[tuple[str, torch.Tensor]]:
    """Add the missing half of each tied pair. An engine (vLLM) keeps its own copy of a tied output head on
    some backends (the CPU one repacks it), so the head must be sent along with the embedding."""
    if not tied:
        return weights
    names = {n: t for n, t in weights}
    extra = []
    for head, embed in tied.items():
        if embed in names and head not in names:
            extra.append((head, names[embed]))
        elif head in names and embed not in names:
            extra.append((embed, names[head]))
    return weights + extra


def group_of(name: str, packed: Mapping[str, list[str]]) -> str:
    """The engine module a checkpoint tensor loads into: its parent module, with the shard names of
    fused modules (``q_proj`` -> ``qkv_proj``) replaced."""
    module = name.rsplit(".", 1)[0]
    parent, _, leaf = module.rpartition(".")
    for fused, shards in packed.items():
        if leaf in shards:
            return f"{parent}.{fused}" if parent else fused
    return module


def check_update(
    weights: Iterable[tuple[str, torch.Tensor]],
    expected: Mapping[str, tuple[int, ...]],
    packed: Mapping[str, list[str]] = DEFAULT_PACKED,
) -> list[tuple[str, torch.Tensor]]:
    """Validate an update; return it as a list. Raises :class:`WeightSyncError` (a ``ValueError``)
    for a non-tensor, a non-floating-point tensor, a repeated name, an unknown name (with the closest known names), a wrong
    shape, or a fused module given only in part (the engine would load the missing shards as garbage)."""
    items = list(weights)
    seen: set[str] = set()
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"rollout weight update: {name!r} is a {type(tensor).__name__}, not a tensor")
        if not tensor.is_floating_point():
            raise WeightSyncError(f"rollout weight update: {name!r} has dtype {tensor.dtype}; the engine's weights are floating point")
        if name in seen:
            raise WeightSyncError(f"rollout weight update: {name!r} is given twice")
        seen.add(name)
        if name not in expected:
            close = difflib.get_close_matches(name, list(expected), n=3, cutoff=0.6)
            raise WeightSyncError(f"rollout weight update: unknown parameter {name!r}; the engine's closest names: {close}")
        if tuple(tensor.shape) != tuple(expected[name]):
            raise WeightSyncError(f"rollout weight update: {name!r} has shape {tuple(tensor.shape)}, the engine expects {tuple(expected[name])}")
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
    return items
