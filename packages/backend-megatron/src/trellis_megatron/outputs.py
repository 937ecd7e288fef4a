"""Forward outputs (``trellis.kit.backend.OUTPUTS``) from vocabulary-parallel logits: each
tensor-parallel rank holds ``vocab / tp`` columns and only per-position sums cross ranks (no rank
ever holds a full-vocabulary row)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region, vocab_parallel_cross_entropy

from trellis import Batch
from trellis.kit.backend import value_outputs


def _tp_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel group. Backward passes the gradient through unchanged: what
    follows the sum is computed identically on every rank, so each rank's gradient of the sum
    is already the whole one (summing it over ranks would count it tp times)."""
    return reduce_from_tensor_model_parallel_region(t)


def _tp_max(t: torch.Tensor) -> torch.Tensor:
    """Max over the tensor-parallel group, as a constant (log-softmax does not depend on the shift)."""
    t = t.detach().clone()
    group = mpu.get_tensor_model_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def _vocab_start(logits: torch.Tensor) -> int:
    """The vocabulary id of this tensor-parallel rank's first column of ``logits`` ``(..., vocab / tp)``."""
    return mpu.get_tensor_model_parallel_rank() * logits.shape[-1]


def mask_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``logits`` ``(..., vocab / tp)`` with the columns past the model's true ``vocab_size``
    (Megatron pads the vocabulary to split it evenly) set to ``-inf``."""
    local, start = logits.shape[-1], _vocab_start(logits)
    if start + local <= vocab_size:
        return logits
    column = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(column >= vocab_size, float("-inf"))


def log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log p(token)`` ``(...)`` from vocabulary-parallel ``logits`` ``(..., vocab / tp)``."""
    # Megatron's cross entropy shifts its input in place: hand it a copy
    return -vocab_parallel_cross_entropy(logits.clone(), tokens)


def _shifted(logits: torch.Tensor):
    """``(z - max, exp(z - max), log sum exp(z - max))`` with the max and the sum over every rank."""
    z = logits - _tp_max(logits.max(dim=-1, keepdim=True).values)
    e = z.exp()
    return z, e, torch.log(_tp_sum(e.sum(-1)))


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """``-sum_v p log p`` ``(...)``: ``log Z - E_p[z]``, from two per-position sums; ``-inf``
    logits contribute 0."""
    z, e, log_z = _shifted(logits)
    mean_z = _tp_sum((e * z.masked_fill(torch.isneginf(z), 0.0)).sum(-1)) / log_z.exp()
    return log_z - mean_z


def sum_sq_probs(logits: torch.Tensor) -> torch.Tensor:
    """``sum_v p^2`` ``(...)``: ``sum exp(2 (z - max)) / Z^2``."""
    _, e, log_z = _shifted(logits)
    return _tp_sum((e * e).sum(-1)) / (2 * log_z).exp()


def top_log_probs(logits: torch.Tensor, k: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest log-probs ``(..., k)`` and their vocabulary ids (``k`` 0: all
    ``vocab_size``), descending, without gradient: each rank's own top ``k`` of its columns,
    gathered over the group (``k x tp`` candidates a position), the top ``k`` of those."""
    k = vocab_size if k <= 0 else min(k, vocab_size)
    with torch.no_grad():
        z, _, log_z = _shifted(logits)
        local = z.topk(min(k, z.shape[-1]), dim=-1)
        values, ids = local.values - log_z[..., None], local.indices + _vocab_start(logits)
        group = mpu.get_tensor_model_parallel_group()
        if dist.get_world_size(group) > 1:
            values, ids = (_all_gather(t, group) for t in (values, ids))
        best = values.topk(k, dim=-1)
        return best.values, ids.gather(-1, best.indices)


def log_probs_at(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log p`` ``(..., m)`` of the vocabulary ids ``(..., m)`` (with gradient): each rank picks
    the ids among its columns, one sum over the group puts them together."""
    z, _, log_z = _shifted(logits)
    start, local = _vocab_start(logits), logits.shape[-1]
    inside = (ids >= start) & (ids < start + local)
    picked = z.gather(-1, (ids - start).clamp(0, local - 1)).masked_fill(~inside, 0.0)
    return _tp_sum(picked) - log_z[..., None]


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """The ranks' ``t`` side by side on the last dimension, in rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, -1)


TOP_OUTPUTS = ("top_log_probs", "top_ids", "top_ids_log_probs")


def lm_outputs(logits: torch.Tensor, micro: Batch, outputs: tuple[str, ...], vocab_size: int) -> dict[str, torch.Tensor]:
    """``log_probs`` / ``entropy`` / ``sum_sq_probs`` ``(batch, response_len)`` and ``top_log_probs``
    / ``top_ids`` / ``top_ids_log_probs`` ``(batch, response_len, k)`` at the response positions
    (logits divided by ``micro.meta["temperature"]``) and ``label_log_probs``
    ``(batch, seq_len - 1)``, from vocabulary-parallel ``logits`` ``(batch, seq_len, vocab / tp)``."""
    logits = mask_padding(logits.float(), vocab_size)
    out: dict[str, torch.Tensor] = {}
    if {"log_probs", "entropy", "sum_sq_probs", *TOP_OUTPUTS} & set(outputs):
        responses = micro["responses"].to(logits.device)
        scaled = logits[:, -responses.shape[1] - 1 : -1] / float(micro.meta.get("temperature", 1.0))
        if "log_probs" in outputs:
            out["log_probs"] = log_probs(scaled, responses)
        if "entropy" in outputs:
            out["entropy"] = entropy(scaled)
        if "sum_sq_probs" in outputs:
            out["sum_sq_probs"] = sum_sq_probs(scaled)
        if {"top_log_probs", "top_ids"} & set(outputs):
            out["top_log_probs"], out["top_ids"] = top_log_probs(scaled, int(micro.meta.get("top_k", 0)), vocab_size)
        if "top_ids_log_probs" in outputs:
            out["top_ids_log_probs"] = log_probs_at(scaled, micro["top_ids"].to(logits.device))
    if "label_log_probs" in outputs:
        out["label_log_probs"] = log_probs(logits[:, :-1], micro["input_ids"][:, 1:].to(logits.device))
    return out


def role_outputs(model_out: torch.Tensor, micro: Batch, outputs: tuple[str, ...], head: str, vocab_size: int) -> dict[str, torch.Tensor]:
    """The named outputs of the last pipeline stage's output: LM logits or the value head ``(batch, seq_len, 1)``."""
    if head == "value":
        return value_outputs(model_out[..., 0], micro, outputs)
    return lm_outputs(model_out, micro, outputs, vocab_size)
