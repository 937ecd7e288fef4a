"""Activation memory of a role's update, estimated from the model's config.json before anything is built.

The estimate counts the values a decoder layer of a Llama/Qwen-style model (RMSNorm, grouped-query
attention, SwiGLU MLP, no dropout) keeps for its backward, per token, in the compute dtype, the way
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1)
count a GPT layer's, with an attention kernel that keeps no ``(seq, seq)`` scores (flash or
memory-efficient SDPA):

- attention: the norm's input, the q/k/v projections' input, q (``hidden``), k and v (``kv_hidden``
  each), the kernel's output and the output projection's input: ``5 hidden + 2 kv_hidden``;
- MLP: the norm's input, the gate/up projections' input (``hidden`` each), gate, up, the activation
  and the down projection's input (``intermediate`` each): ``2 hidden + 4 intermediate``.

So a layer keeps ``7 hidden + 2 kv_hidden + 4 intermediate`` values per token; with activation
checkpointing only each layer's input (``hidden``) stays, and one layer's values come back during
its backward. The LM head adds ``vocab`` values per position it runs on (those predicting response
tokens), and packing under SDPA a ``(tokens, tokens)`` bool mask. Tensor parallelism splits it all.
Weights, gradients, optimizer state, a colocated engine's memory and the float32 copies the norms
make are left out: the figure is a lower bound, so a warning is never a false alarm, and a run
may still run out of memory without one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from trellis import resolve_component
from trellis.kit.recipe import backend_mesh, text_config

log = logging.getLogger("trellis")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only model that its activations scale with."""

    layers: int
    hidden: int
    kv_hidden: int  # key/value heads x head size (hidden without grouped-query attention)
    intermediate: int
    vocab: int

    @staticmethod
    def read(model_path: str | Path) -> ModelShape | None:
        """The shape a Hugging Face ``config.json`` gives (its ``text_config`` for a multimodal
        model); None when the folder has none or it lacks a size."""
        config = text_config(model_path)
        try:
            hidden, heads = config["hidden_size"], config["num_attention_heads"]
            head_dim = config.get("head_dim") or hidden // heads
            kv_heads = config.get("num_key_value_heads") or heads
            return ModelShape(config["num_hidden_layers"], hidden, kv_heads * head_dim, config["intermediate_size"], config["vocab_size"])
        except KeyError:
            return None

    def layer_values(self) -> int:
        """Values one decoder layer keeps for its backward, per token."""
        return 7 * self.hidden + 2 * self.kv_hidden + 4 * self.intermediate


def activation_bytes(
    shape: ModelShape, tokens: int, logit_tokens: int, value_bytes: int, checkpointing: bool, packed: bool = False, tp: int = 1
) -> int:
    """Bytes of activations one forward of ``tokens`` tokens keeps for its backward, on one of
    ``tp`` tensor-parallel ranks; ``logit_tokens`` of them go through the LM head."""
    # checkpointed: each layer's input, and one layer's values again while its backward runs
    per_token = shape.layers * shape.hidden + shape.layer_values() if checkpointing else shape.layers * shape.layer_values()
    values = tokens * per_token + logit_tokens * shape.vocab
    mask = tokens * tokens if packed else 0
    return values * value_bytes // tp + mask


def micro_batch_tokens(role_options: Any, seq_len: int) -> int:
    """The most (padded) tokens one of a role's micro-batches holds, with sequences of ``seq_len``:
    the token budget (a longer sample runs alone), else ``micro_batch_samples`` full sequences."""
    budget = role_options.max_tokens_per_micro_batch
    return max(budget, seq_len) if budget > 0 else role_options.micro_batch_samples * seq_len


def check_activation_memory(cfg: DictConfig, registry: Any, role: str, seq_len: int, response_len: int) -> str | None:
    """On CUDA, warn (and return the line) when the activations of one of ``role``'s micro-batches
    (sequences of ``seq_len`` tokens, ``response_len`` of them response) exceed the device's memory,
    naming the keys that lower them. Nothing on CPU, or when ``model.path`` has no config.json."""
    shape = ModelShape.read(cfg.model.path)
    if shape is None or not torch.cuda.is_available():
        return None
    _, options = resolve_component(registry, "backend", cfg.backend)
    role_options = cfg[role]
    dtype_of = getattr(options, "activation_dtype", None)
    dtype = dtype_of("cuda") if callable(dtype_of) else "bfloat16"  # a backend that does not say: 16-bit
    value_bytes = torch.finfo(getattr(torch, dtype)).bits // 8
    checkpointing = getattr(options, "activation_checkpointing", None)  # None: the backend has no such option
    packed = bool(getattr(options, "padding_free", False))
    tp = backend_mesh(cfg, registry).tp

    def need(tokens: int) -> int:
        return activation_bytes(shape, tokens, tokens * response_len // seq_len, value_bytes, bool(checkpointing), packed, tp)

    tokens = micro_batch_tokens(role_options, seq_len)
    props = torch.cuda.get_device_properties(0)
    if need(tokens) <= props.total_memory:
        return None
    fits, over = 0, tokens  # the most tokens that fit: need() grows with tokens
    while over - fits > 1:
        mid = (fits + over) // 2
        fits, over = (mid, over) if need(mid) <= props.total_memory else (fits, mid)
    if role_options.max_tokens_per_micro_batch > 0:
        lower = f"lower {role}.max_tokens_per_micro_batch (now {role_options.max_tokens_per_micro_batch}) to {fits} or less"
    else:
        lower = f"lower {role}.micro_batch_samples (now {role_options.micro_batch_samples}) to {fits // seq_len} or less"
    if fits < seq_len:
        lower = f"shorten the sequences (data.max_prompt_length + sampling.max_new_tokens = {seq_len} tokens)"
    fixes = ["set backend.activation_checkpointing=true"] * (checkpointing is False) + [lower]
    line = (
        f"{role} update: a micro-batch of {tokens} tokens keeps at least {need(tokens) / 2**30:.1f} GiB of activations "
        f"({shape.layers} layers x hidden {shape.hidden}, {dtype}, activation checkpointing {'on' if checkpointing else 'off'}), "
        f"more than the {props.total_memory / 2**30:.1f} GiB of {props.name}; {', or '.join(fixes)}"
    )
    log.warning(line)
    return line
