"""Helpers for backends that run Hugging Face models: load a folder with the role's head, and the
forward outputs (``trellis.interfaces.backend.OUTPUTS``) from its logits or value head, so no
backend repeats the slicing."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from trellis.batch import Batch


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    """``-sum_v p log p`` over the last dim, in float32 (or wider), from ``log_softmax`` so large
    logits do not overflow; ``-inf`` logits (banned tokens) contribute 0 instead of ``nan``."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_p = torch.log_softmax(logits, dim=-1)
    p = log_p.exp()
    log_p = log_p.masked_fill(torch.isneginf(log_p), 0.0)
    return -(p * log_p).sum(dim=-1)


def _sum_sq_rows(logits: torch.Tensor) -> torch.Tensor:
    """``sum_v p^2`` over the last dim, in float32 (or wider), from ``log_softmax`` so large
    logits neither overflow nor lose precision; ``-inf`` logits contribute 0."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.exp(2.0 * torch.log_softmax(logits, dim=-1)).sum(dim=-1)


def _by_rows(rows_fn, logits: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
    """``rows_fn`` ``(..., vocab) -> (...)`` over ``chunk_size`` positions at a time (all at once
    for None); each chunk is checkpointed when a gradient is needed."""
    if chunk_size is None:
        return rows_fn(logits)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    rows = logits.reshape(-1, logits.shape[-1])
    keep_graph = torch.is_grad_enabled() and rows.requires_grad
    parts = [
        checkpoint(rows_fn, chunk, use_reentrant=False) if keep_graph else rows_fn(chunk)
        for chunk in rows.split(chunk_size, dim=0)
    ]
    out = torch.cat(parts) if parts else rows.new_zeros(0, dtype=torch.promote_types(rows.dtype, torch.float32))
    return out.reshape(logits.shape[:-1])


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of the categorical distribution of every position: ``(..., vocab) -> (...)``.

    The result is float32 (float64 for float64 logits). With ``chunk_size``, rows (positions) are
    processed ``chunk_size`` at a time, so at most one chunk's ``(chunk, vocab)`` float32
    temporaries exist at once; when a gradient is needed, each chunk is checkpointed (its softmax is
    recomputed in the backward pass instead of kept), which is what bounds memory in training.
    """
    return _by_rows(_entropy_rows, logits, chunk_size)


def sum_sq_probs_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """``sum_v p_v^2`` of the categorical distribution of every position: ``(..., vocab) -> (...)``
    (the optimal token baseline's path-variance term), chunked as :func:`entropy_from_logits`."""
    return _by_rows(_sum_sq_rows, logits, chunk_size)


def _gather(log_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def lm_outputs(logits: torch.Tensor, micro: Batch, outputs: tuple[str, ...], entropy_chunk_size: int | None = None) -> dict[str, torch.Tensor]:
    """``log_probs`` / ``entropy`` / ``sum_sq_probs`` ``(batch, response_len)`` at the response positions (logits
    divided by ``micro.meta["temperature"]``) and ``label_log_probs`` ``(batch, seq_len - 1)``,
    from a causal LM's ``logits`` ``(batch, positions, vocab)``: every position, or (without
    ``label_log_probs``) at least the last ``response_len + 1``."""
    out: dict[str, torch.Tensor] = {}
    if {"log_probs", "entropy", "sum_sq_probs"} & set(outputs):
        responses = micro["responses"].to(logits.device)
        n = responses.shape[1]
        scaled = logits[:, -n - 1 : -1].float() / float(micro.meta.get("temperature", 1.0))
        if "log_probs" in outputs:
            out["log_probs"] = _gather(torch.log_softmax(scaled, dim=-1), responses)
        if "entropy" in outputs:
            out["entropy"] = entropy_from_logits(scaled, entropy_chunk_size)
        if "sum_sq_probs" in outputs:
            out["sum_sq_probs"] = sum_sq_probs_from_logits(scaled, entropy_chunk_size)
    if "label_log_probs" in outputs:
        labels = micro["input_ids"][:, 1:].to(logits.device)
        out["label_log_probs"] = _gather(torch.log_softmax(logits[:, :-1].float(), dim=-1), labels)
    return out


def value_outputs(head: torch.Tensor, micro: Batch, outputs: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``values`` ``(batch, response_len)`` at the positions that predict each response token and
    ``scores`` ``(batch,)`` at the last attended token, from a value head ``(batch, seq_len)``."""
    out: dict[str, torch.Tensor] = {}
    if "values" in outputs:
        n = micro["responses"].shape[1]
        out["values"] = head[:, -n - 1 : -1].float()
    if "scores" in outputs:
        last = micro["attention_mask"].to(head.device).cumsum(-1).argmax(-1)
        out["scores"] = _gather(head, last).float()
    return out


def load_hf_model(path: str, head: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model of a Hugging Face folder: a causal LM (head ``lm``) or the same body with a
    one-label token-classification head (``value``: critic, reward model); KV cache off."""
    if head == "value":
        model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.config.use_cache = False
    return model


def forward_outputs(
    model: torch.nn.Module, micro: Batch, outputs: tuple[str, ...], head: str, entropy_chunk_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Run ``model`` on the micro-batch's ``input_ids``, ``attention_mask``, ``position_ids`` (moved
    to the model's device) and return the named ``outputs``."""
    device = next(model.parameters()).device
    inputs = {k: micro[k].to(device) for k in ("input_ids", "attention_mask", "position_ids")}
    if head == "value":
        return value_outputs(model(**inputs).logits[..., 0], micro, outputs)
    if "label_log_probs" not in outputs:
        # only the positions that predict response tokens go through the LM head (vocab-wide
        # logits over the prompt would be computed and thrown away)
        inputs["logits_to_keep"] = micro["responses"].shape[1] + 1
    return lm_outputs(model(**inputs).logits, micro, outputs, entropy_chunk_size)
