"""Helpers for backends that run Hugging Face models: build or load a folder's model with the
role's head, and the forward outputs (``trellis.interfaces.backend.OUTPUTS``) from its logits or
value head, padded or padding-free (packed), so no backend repeats the slicing."""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification, modeling_utils

from trellis.batch import Batch, last_valid_index
from trellis.interfaces.backend import IMAGE_INPUTS, MODEL_INPUTS, join_images
from trellis.interfaces.moe import MOE_OUTPUTS, ROUTED_EXPERTS, ROUTER_REPLAY, RouterHooks, own_routing
from trellis.interfaces.rollout import placeholder_ids

# transformers 5.21 on: models take a (batch, seq_len) boolean `logits_to_keep` (its
# `slice_logits_to_keep`); before, only an int or 1-D positions (vLLM 0.32 pins < 5.20)
MASKED_LOGITS = hasattr(modeling_utils, "slice_logits_to_keep")


def _float(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits in float32 (or wider), divided by the sampling temperature."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits if temperature == 1.0 else logits / temperature


def _entropy_rows(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``-sum_v p log p`` over the last dim, in float32 (or wider), from ``log_softmax`` so large
    logits do not overflow; ``-inf`` logits (banned tokens) contribute 0 instead of ``nan``."""
    log_p = torch.log_softmax(_float(logits, temperature), dim=-1)
    p = log_p.exp()
    log_p = log_p.masked_fill(torch.isneginf(log_p), 0.0)
    return -(p * log_p).sum(dim=-1)


def _sum_sq_rows(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``sum_v p^2`` over the last dim, in float32 (or wider), from ``log_softmax`` so large
    logits neither overflow nor lose precision; ``-inf`` logits contribute 0."""
    return torch.exp(2.0 * torch.log_softmax(_float(logits, temperature), dim=-1)).sum(dim=-1)


def _log_prob_rows(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log p(token)`` of each row (:func:`_log_probs_at_rows` at one id a row)."""
    return _log_probs_at_rows(logits, tokens.unsqueeze(-1), temperature).squeeze(-1)


def _by_rows(rows_fn, logits: torch.Tensor, chunk_size: int | None, *per_row: torch.Tensor) -> torch.Tensor:
    """``rows_fn(rows (k, vocab), *per_row (k, ...)) -> (k, ...)`` over ``chunk_size`` positions at a
    time (all at once for None); each chunk is checkpointed when a gradient is needed, so at most
    one chunk's float32 ``(chunk, vocab)`` temporaries exist at once, in the forward and the backward.
    ``per_row`` tensors are shaped ``logits.shape[:-1] + (...)``; so is the result."""
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    lead = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])
    extras = [t.reshape(rows.shape[0], *t.shape[len(lead) :]) for t in per_row]
    if chunk_size is None:
        out = rows_fn(rows, *extras)
        return out.reshape(*lead, *out.shape[1:])
    keep_graph = torch.is_grad_enabled() and rows.requires_grad
    parts = []
    for start in range(0, rows.shape[0], chunk_size):
        args = [t[start : start + chunk_size] for t in (rows, *extras)]
        parts.append(checkpoint(rows_fn, *args, use_reentrant=False) if keep_graph else rows_fn(*args))
    if not parts:
        return rows.new_zeros(lead, dtype=torch.promote_types(rows.dtype, torch.float32))
    out = torch.cat(parts)
    return out.reshape(*lead, *out.shape[1:])


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the categorical distribution of every position: ``(..., vocab) -> (...)``.

    The result is float32 (float64 for float64 logits). With ``chunk_size``, rows (positions) are
    processed ``chunk_size`` at a time, so at most one chunk's ``(chunk, vocab)`` float32
    temporaries exist at once; when a gradient is needed, each chunk is checkpointed (its softmax is
    recomputed in the backward pass instead of kept), which is what bounds memory in training.
    """
    return _by_rows(functools.partial(_entropy_rows, temperature=temperature), logits, chunk_size)


def sum_sq_probs_from_logits(logits: torch.Tensor, chunk_size: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """``sum_v p_v^2`` of the categorical distribution of every position: ``(..., vocab) -> (...)``
    (the optimal token baseline's path-variance term), chunked as :func:`entropy_from_logits`."""
    return _by_rows(functools.partial(_sum_sq_rows, temperature=temperature), logits, chunk_size)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, chunk_size: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """``log p(tokens)`` ``(...)`` under ``logits / temperature`` ``(..., vocab)``, as gather minus
    logsumexp, chunked as :func:`entropy_from_logits`."""
    return _by_rows(functools.partial(_log_prob_rows, temperature=temperature), logits, chunk_size, tokens)


def top_log_probs(logits: torch.Tensor, k: int, chunk_size: int | None = None, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest log-probs ``(..., k)`` of every position's next-token distribution
    (``logits / temperature`` ``(..., vocab)``), descending, and their token ids ``(..., k)``;
    ``k`` 0 or above the vocabulary: all of it. No gradient; chunked over positions (at most one
    chunk's ``(chunk, vocab)`` float32 log-softmax exists at once)."""
    k = logits.shape[-1] if k <= 0 else min(k, logits.shape[-1])
    lead, rows = logits.shape[:-1], logits.reshape(-1, logits.shape[-1])
    step = rows.shape[0] if chunk_size is None else chunk_size
    values, ids = [], []
    with torch.no_grad():
        for start in range(0, rows.shape[0], max(step, 1)):
            top = torch.log_softmax(_float(rows[start : start + step], temperature), dim=-1).topk(k, dim=-1)
            values.append(top.values)
            ids.append(top.indices)
    if not values:
        return rows.new_zeros(*lead, k, dtype=torch.float32), torch.zeros(*lead, k, dtype=torch.long, device=rows.device)
    return torch.cat(values).reshape(*lead, k), torch.cat(ids).reshape(*lead, k)


def _log_probs_at_rows(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log p(ids)`` ``(k, m)`` of each row's distribution at its ``m`` token ids ``(k, m)``: the
    ids' logits minus the row's ``logsumexp`` (no ``(rows, vocab)`` log-softmax is kept), in
    float32 (or wider)."""
    scaled = _float(logits, temperature)
    return scaled.gather(-1, ids) - torch.logsumexp(scaled, dim=-1, keepdim=True)


def log_probs_at(logits: torch.Tensor, ids: torch.Tensor, chunk_size: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """``log p`` ``(..., m)`` of the token ids ``(..., m)`` under each position's ``logits /
    temperature`` ``(..., vocab)`` (with gradient), chunked as :func:`entropy_from_logits`."""
    return _by_rows(functools.partial(_log_probs_at_rows, temperature=temperature), logits, chunk_size, ids)


def _response_rows(
    logits: torch.Tensor, tokens: torch.Tensor, outputs: tuple[str, ...], micro: Batch, chunk_size: int | None, top_ids: torch.Tensor | None
):
    """The response outputs of rows of logits ``(..., vocab)`` that predict ``tokens`` ``(...)``
    (``top_ids`` ``(..., k)``: the same rows of the micro-batch's ``top_ids``, when asked for)."""
    temperature = float(micro.meta.get("temperature", 1.0))
    out: dict[str, torch.Tensor] = {}
    if "log_probs" in outputs:
        out["log_probs"] = token_log_probs(logits, tokens, chunk_size, temperature)
    if "entropy" in outputs:
        out["entropy"] = entropy_from_logits(logits, chunk_size, temperature)
    if "sum_sq_probs" in outputs:
        out["sum_sq_probs"] = sum_sq_probs_from_logits(logits, chunk_size, temperature)
    if {"top_log_probs", "top_ids"} & set(outputs):
        out["top_log_probs"], out["top_ids"] = top_log_probs(logits, int(micro.meta.get("top_k", 0)), chunk_size, temperature)
    if "top_ids_log_probs" in outputs:
        out["top_ids_log_probs"] = log_probs_at(logits, top_ids.to(logits.device), chunk_size, temperature)
    return out


RESPONSE_OUTPUTS = ("log_probs", "entropy", "sum_sq_probs", "top_log_probs", "top_ids", "top_ids_log_probs")


def lm_outputs(logits: torch.Tensor, micro: Batch, outputs: tuple[str, ...], chunk_size: int | None = None) -> dict[str, torch.Tensor]:
    """``log_probs`` / ``entropy`` / ``sum_sq_probs`` ``(batch, response_len)`` and ``top_log_probs``
    / ``top_ids`` / ``top_ids_log_probs`` ``(batch, response_len, k)`` at the response positions (logits
    divided by ``micro.meta["temperature"]``) and ``label_log_probs`` ``(batch, seq_len - 1)``,
    from a causal LM's ``logits`` ``(batch, positions, vocab)``: every position, or (without
    ``label_log_probs``) at least the last ``response_len + 1``. ``chunk_size`` bounds the float32
    temporaries (see :func:`entropy_from_logits`)."""
    out: dict[str, torch.Tensor] = {}
    if set(RESPONSE_OUTPUTS) & set(outputs):
        responses = micro["responses"].to(logits.device)
        n = responses.shape[1]
        top_ids = micro["top_ids"] if "top_ids_log_probs" in outputs else None
        out.update(_response_rows(logits[:, -n - 1 : -1], responses, outputs, micro, chunk_size, top_ids))
    if "label_log_probs" in outputs:
        labels = micro["input_ids"][:, 1:].to(logits.device)
        out["label_log_probs"] = token_log_probs(logits[:, :-1], labels, chunk_size)
    return out


def value_outputs(head: torch.Tensor, micro: Batch, outputs: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``values`` ``(batch, response_len)`` at the positions that predict each response token and
    ``scores`` ``(batch,)`` at the last attended token, from a value head ``(batch, seq_len)``."""
    out: dict[str, torch.Tensor] = {}
    if "values" in outputs:
        n = micro["responses"].shape[1]
        out["values"] = head[:, -n - 1 : -1].float()
    if "scores" in outputs:
        last = last_valid_index(micro["attention_mask"].to(head.device))
        out["scores"] = head.gather(-1, last.unsqueeze(-1)).squeeze(-1).float()
    return out


# heads with one scalar per position: ``value`` (a critic: a linear layer with a bias) and
# ``reward`` (a reward model: the bias-free ``score`` layer of ``AutoModelForSequenceClassification``,
# so its weights load from and export to a sequence-classification folder unchanged)
SCALAR_HEADS = ("value", "reward")


def takes_images(config) -> bool:
    """Whether a model config has a vision tower (``vision_config``: Qwen2-VL, Qwen2.5-VL, ...)."""
    return getattr(config, "vision_config", None) is not None


def _model_class(head: str, config):
    if head not in SCALAR_HEADS:
        return AutoModelForImageTextToText if takes_images(config) else AutoModelForCausalLM
    if takes_images(config):
        raise ValueError(
            f"a {head} head on the vision-language model {config.model_type!r} is not supported (its body is no token-classification "
            "model); give the critic or reward model a text model's folder"
        )
    return AutoModelForTokenClassification


def vision_tower(model: torch.nn.Module) -> str | None:
    """The module name of a vision-language model's vision tower (``model.visual`` in the Qwen2-VL
    family; ``vision_tower`` or ``vision_model`` in others); None for a text model."""
    return next((name for name, _ in model.named_modules() if name.rpartition(".")[2] in ("visual", "vision_tower", "vision_model")), None)


def causal_lm_class(path: str):
    """The ``transformers`` auto class that loads the folder ``path`` with its LM head: image-text-to-text
    for a vision-language model (its vision tower included), else causal LM."""
    return _model_class("lm", AutoConfig.from_pretrained(path))


def image_kwargs(config, input_ids: torch.Tensor, per_sample, response_len: int = 0) -> dict:
    """What a vision-language model takes for the images of a micro-batch (``per_sample``: its
    :data:`IMAGE_INPUTS` field, None without one), empty when no sample has an image: each image
    input joined on dimension 0 in sample order (a sample's images in the order of their slots: the
    prompt's, then those environment turns returned); ``input_ids`` with each placeholder the model
    sampled in the last ``response_len`` columns read as token 0 (:func:`sampled_placeholders`: it
    ended its turn, :func:`~trellis.interfaces.rollout.stop_ids`, so no output read depends on it, and
    it has no image); ``mm_token_type_ids`` ``(batch, seq_len)`` (1 on image slots, 2 on video ones);
    ``position_ids`` None, so the model lays out its multimodal rotary positions (mrope) itself."""
    given = [inputs for inputs in (per_sample if per_sample is not None else ()) if inputs]
    if not given:
        return {}
    image, video = config.image_token_id, getattr(config, "video_token_id", None)
    if response_len:
        sampled = sampled_placeholders(config, input_ids[:, -response_len - 1 :])[:, 1:]
        input_ids = torch.cat([input_ids[:, :-response_len], input_ids[:, -response_len:].masked_fill(sampled, 0)], 1)
    types = (input_ids == image).int() + (2 * (input_ids == video).int() if video is not None else 0)
    joined = {name: tensor.to(input_ids.device) for name, tensor in join_images(*given).items()}
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    if merge and "image_grid_thw" in joined:
        slots, filled = int((types == 1).sum()), int(joined["image_grid_thw"].prod(-1).sum()) // merge**2
        if slots != filled:
            raise ValueError(
                f"these token ids hold {slots} image slots and their images fill {filled}: a sample's images (multi_modal_inputs) "
                "and the image placeholders of its token ids disagree"
            )
    return {**joined, "input_ids": input_ids, "mm_token_type_ids": types, "position_ids": None}


def sampled_placeholders(config, ids: torch.Tensor) -> torch.Tensor:
    """``(batch, len)`` bool: the placeholder tokens of ``ids`` that are no image's slot. A slot is a
    run of placeholders right after the token that opens an image (``vision_start_token_id``: the
    chat template renders each image so, for a prompt and for an environment turn alike); a model
    that samples a placeholder ends its turn there, and one that samples the opening token too, so
    its placeholders never follow one. Without an opening token every placeholder counts as sampled."""
    pads = torch.isin(ids, torch.tensor(placeholder_ids(config), device=ids.device))
    opening = getattr(config, "vision_start_token_id", None)
    if opening is None:
        return pads
    before = torch.cat([torch.zeros_like(pads[:, :1]), pads[:, :-1]], 1)
    previous = torch.cat([torch.full_like(ids[:, :1], -1), ids[:, :-1]], 1)
    starts = pads & ~before  # the first placeholder of each run
    run = torch.cumsum(starts, 1) * pads  # each run's number in its row (0: no placeholder)
    opened = torch.zeros(len(ids), int(run.max()) + 1, dtype=torch.bool, device=ids.device)
    opened.scatter_(1, run * starts, starts & (previous == opening))
    return pads & ~opened.gather(1, run)


def _config(path: str, head: str):
    """The folder's config, with one label for a scalar head and no dropout before it
    (transformers' default is 0.1): a critic's values must be the same in its no-grad pass and
    in its update's forward."""
    if head not in SCALAR_HEADS:
        return AutoConfig.from_pretrained(path)
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    if head == "reward":
        config.token_classification_bias = False  # read by transformers' generic token-classification models
    return config


def _checked(model: torch.nn.Module, path: str, head: str) -> torch.nn.Module:
    """``model`` with its KV cache off; for the ``reward`` head, refused unless its head is the
    bias-free ``score`` layer a sequence-classification folder holds."""
    for config in (model.config, getattr(model.config, "text_config", None)):  # a vision-language model's language model reads its own
        if config is not None:
            config.use_cache = False
    score = getattr(model, "score", None)
    if head == "reward" and not (isinstance(score, torch.nn.Linear) and score.bias is None):
        raise ValueError(
            f"model {path!r} ({type(model).__name__}): the reward head needs transformers' generic token-classification "
            "model (a bias-free linear `score` layer, as Llama, Qwen2, Qwen3 and Mistral have); this architecture has another head"
        )
    return model


SDPA_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


def grouped_query_sdpa() -> None:
    """In a process without CUDA, attention with fewer key/value heads than query heads (GQA) runs
    as one sdpa call over the key/value heads (``enable_gqa``) also where a mask is given: no copy
    of the keys and values for each query head (or, decoding, of the queries regrouped), which
    transformers makes unless the mask is absent because CUDA's fused kernels take no mask with
    GQA; CPU's do, with the same results to rounding. Sets transformers'
    ``TRANSFORMERS_SDPA_FORCE_GQA=1`` (read at every attention call; transformers before 5.23
    reads no such switch and keeps copying) unless the environment sets it. Called wherever a
    model is built (backends, engines), so every process of a run agrees."""
    if not torch.cuda.is_available():
        os.environ.setdefault(SDPA_GQA, "1")


def load_hf_model(path: str, head: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model of a Hugging Face folder: a causal LM (head ``lm``) or the same body with a
    one-label token-classification head (``value``: a critic; ``reward``: a reward model, whose
    ``score`` layer a sequence-classification folder's fills), no dropout before it; KV cache off.
    Grouped-query attention as :func:`grouped_query_sdpa` sets it."""
    grouped_query_sdpa()
    config = _config(path, head)
    model = _model_class(head, config).from_pretrained(path, config=config, dtype=dtype)
    return _checked(model, path, head)


def empty_hf_model(path: str, head: str, dtype: torch.dtype) -> torch.nn.Module:
    """The same model as :func:`load_hf_model` built from the folder's ``config.json`` alone, with
    every parameter on the meta device (no weights read, no memory taken: shard it, then
    materialise and load) and every buffer real, as the model's constructor computed it (rotary
    ``inv_freq`` and the like, which no checkpoint holds): see :func:`keep_buffers`."""
    grouped_query_sdpa()
    config = _config(path, head)
    with _parameters_on_meta():
        model = _model_class(head, config).from_config(config, dtype=dtype)
    return _checked(model, path, head)


def linear_layers(path: str) -> list[str]:
    """The module names of the causal LM's linear layers (``torch.nn.Linear``, GPT-2's
    ``Conv1D``) in the folder ``path``, from its ``config.json`` alone (no weight read)."""
    from transformers.pytorch_utils import Conv1D

    model = empty_hf_model(path, "lm", torch.float32)
    return [name for name, module in model.named_modules() if isinstance(module, (torch.nn.Linear, Conv1D))]


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter a module registers goes to the meta device (modules still compute their
    buffers for real, unlike under ``torch.device("meta")``); a parameter's host tensor is only
    ever ``torch.empty``, never written, so it takes no memory."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def keep_buffers(model: torch.nn.Module):
    """``restore()`` puts back the values ``model``'s buffers have now, after ``to_empty`` (which
    materialises parameters and buffers alike as uninitialised memory) moved them."""
    saved = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}

    def restore() -> None:
        with torch.no_grad():
            for name, value in saved.items():
                model.get_buffer(name).copy_(value)

    return restore


def _packed_inputs(micro: Batch, device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """One row of every sample's attended tokens back to back, with each sample's own positions
    (restarting at 0, from which transformers builds a block-diagonal causal mask), plus the
    ``(batch, seq_len)`` bool mask of attended tokens and their index in the packed row (-1 else)."""
    mask = micro["attention_mask"].bool()
    first = micro["position_ids"].gather(1, mask.int().argmax(-1, keepdim=True)).flatten()
    if (first[mask.any(-1)] != 0).any():
        raise ValueError(
            f"backend.padding_free packs samples by their position_ids, which must start at 0 on each sample's first attended "
            f"token; these start at {first.tolist()}: give position_ids = trellis.batch.position_ids(attention_mask), or set padding_free=false"
        )
    inputs = {"input_ids": micro["input_ids"][mask][None].to(device), "position_ids": micro["position_ids"][mask][None].to(device)}
    return inputs, mask, _packed_rows(mask)


def _packed_images(model: torch.nn.Module, micro: Batch, text_positions: torch.Tensor, mask: torch.Tensor) -> dict:
    """:func:`image_kwargs` for the packed row: the images in sample order, the input ids with a
    response's sampled placeholder read as token 0, and ``position_ids`` ``(4, 1, tokens)``: the
    text positions (from which transformers builds the block-diagonal mask) over each sample's
    multimodal ones, laid out by the model's own ``get_rope_index`` on the padded micro-batch (the
    text positions four times over for a micro-batch without images: a vision-language model builds
    the packed mask only from that layout). Nothing for a text model."""
    if not takes_images(model.config):
        return {}
    device = text_positions.device
    response_len = micro["responses"].shape[1] if "responses" in micro else 0
    images = image_kwargs(model.config, micro["input_ids"].to(device), micro.get(IMAGE_INPUTS), response_len)
    if not images:
        return {"position_ids": text_positions[None].expand(4, -1, -1)}
    rope = next(m for m in model.modules() if hasattr(m, "get_rope_index")).get_rope_index
    grids = {k: images[k] for k in ("image_grid_thw", "video_grid_thw") if k in images}
    positions, _ = rope(
        images["input_ids"], **grids, attention_mask=micro["attention_mask"].to(device), mm_token_type_ids=images["mm_token_type_ids"]
    )
    mask = mask.to(device)
    packed = {k: v for k, v in images.items() if k not in ("input_ids", "mm_token_type_ids", "position_ids")}
    return {**packed, "input_ids": images["input_ids"][mask][None], "position_ids": torch.cat([text_positions[None], positions[:, mask][:, None]])}


def _unpack(rows: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Rows ``(k, ...)`` back into a zero ``where.shape + (...)`` layout at the True entries of
    ``where`` (differentiable)."""
    trailing = rows.shape[1:]
    at = where.to(rows.device).reshape(*where.shape, *(1,) * len(trailing)).expand(*where.shape, *trailing)
    return rows.new_zeros(*where.shape, *trailing).masked_scatter(at, rows)


def packed_outputs(
    model: torch.nn.Module, micro: Batch, outputs: tuple[str, ...], head: str, chunk_size: int | None = None
) -> dict[str, torch.Tensor]:
    """:func:`forward_outputs` without padding: the micro-batch's attended tokens run as one packed
    sequence, and only the positions that predict a real token go through the LM head. The
    results equal the padded forward's at every attended position and are 0 at padding. Needs
    each sample's ``position_ids`` to count 0, 1, 2... over its attended tokens. Samples with images
    get their multimodal positions too (:func:`_packed_images`)."""
    device = next(model.parameters()).device
    inputs, mask, index = _packed_inputs(micro, device)
    inputs.update(_packed_images(model, micro, inputs["position_ids"], mask))
    if head in SCALAR_HEADS:
        return value_outputs(_unpack(model(**inputs).logits[0, :, 0], mask), micro, outputs)
    out: dict[str, torch.Tensor] = {}
    if "label_log_probs" in outputs:
        where = mask[:, 1:] & mask[:, :-1] & _label_rows(micro, outputs)
        logits = model(**inputs, logits_to_keep=index[:, :-1][where].to(device)).logits[0]
        labels = micro["input_ids"][:, 1:][where].to(device)
        out["label_log_probs"] = _unpack(token_log_probs(logits, labels, chunk_size), where)
        # the response rows are a subset of the label rows: reuse them
        if set(RESPONSE_OUTPUTS) & set(outputs):
            full = index.new_full(mask.shape, -1)
            full[:, :-1][where] = torch.arange(int(where.sum()))
            out.update(_packed_response(logits, full, micro, outputs, chunk_size))
        return out
    n = micro["responses"].shape[1]
    where = mask[:, -n:]
    logits = model(**inputs, logits_to_keep=index[:, -n - 1 : -1][where].to(device)).logits[0]
    rows = torch.full(mask.shape, -1, dtype=torch.long)
    rows[:, -n - 1 : -1][where] = torch.arange(int(where.sum()))
    return _packed_response(logits, rows, micro, outputs, chunk_size)


def _packed_response(
    logits: torch.Tensor, rows: torch.Tensor, micro: Batch, outputs: tuple[str, ...], chunk_size: int | None
) -> dict[str, torch.Tensor]:
    """Response outputs ``(batch, response_len)`` from packed logits ``(k, vocab)``; ``rows``
    ``(batch, seq_len)`` gives the logits row at each position (-1: none)."""
    n = micro["responses"].shape[1]
    where = micro["attention_mask"][:, -n:].bool()
    return response_outputs(logits[rows[:, -n - 1 : -1][where].to(logits.device)], micro, where, outputs, chunk_size)


def response_outputs(
    picked: torch.Tensor, micro: Batch, where: torch.Tensor, outputs: tuple[str, ...], chunk_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Response outputs ``(batch, response_len)`` (0 where ``where`` is False) from ``picked``
    ``(where.sum(), vocab)``: the logits that predict the response tokens at the True entries of
    ``where`` ``(batch, response_len)``, in row-major order (a backend with its own layout of the
    micro-batch gathers them, this does the rest)."""
    tokens = micro["responses"][where].to(picked.device)
    top_ids = micro["top_ids"][where] if "top_ids_log_probs" in outputs else None
    out = _response_rows(picked, tokens, outputs, micro, chunk_size, top_ids)
    return {k: _unpack(v, where) for k, v in out.items() if k in RESPONSE_OUTPUTS}


def _label_rows(micro: Batch, outputs: tuple[str, ...]) -> torch.Tensor | bool:
    """``(batch, seq_len - 1)`` True where ``label_log_probs`` are needed: where the micro-batch's
    ``loss_mask`` counts the next token (a supervised batch), else everywhere (True)."""
    if "loss_mask" not in micro or set(RESPONSE_OUTPUTS) & set(outputs):
        return True
    return micro["loss_mask"][:, 1:].bool()


def _logits_where(model: torch.nn.Module, inputs: dict, where: torch.Tensor) -> torch.Tensor:
    """Logits ``(where.sum(), vocab)`` at the True positions of ``where`` ``(batch, seq_len - 1)``,
    in row-major order. Without mask support, the LM head runs on every column a row needs."""
    device = inputs["input_ids"].device
    if MASKED_LOGITS:
        return model(**inputs, logits_to_keep=torch.cat([where, where.new_zeros(len(where), 1)], 1).to(device)).logits
    columns = where.any(0).nonzero()[:, 0]
    return model(**inputs, logits_to_keep=columns.to(device)).logits[where[:, columns].to(device)]


def forward_outputs(
    model: torch.nn.Module,
    micro: Batch,
    outputs: tuple[str, ...],
    head: str,
    chunk_size: int | None = None,
    padding_free: bool = False,
) -> dict[str, torch.Tensor]:
    """Run ``model`` on the micro-batch's ``input_ids``, ``attention_mask``, ``position_ids`` (moved
    to the model's device) and return the named ``outputs``; ``padding_free``: as one packed
    sequence (:func:`packed_outputs`). Only positions whose output is used go through the LM
    head: those predicting response tokens, or, for ``label_log_probs`` of a micro-batch with a
    ``loss_mask``, those predicting a token in the loss (``label_log_probs`` is 0 elsewhere).

    A mixture-of-experts policy (head ``lm``) replays the micro-batch's recorded
    :data:`~trellis.interfaces.moe.ROUTED_EXPERTS` when its meta says ``router_replay: rollout``
    (counting where its own routing differs under ``measure`` too), and returns the router outputs
    (:data:`~trellis.interfaces.moe.MOE_OUTPUTS`) asked for."""
    moe = tuple(o for o in outputs if o in MOE_OUTPUTS)
    mode = micro.meta.get(ROUTER_REPLAY, "off")
    routes = micro.get(ROUTED_EXPERTS) if mode != "off" and head not in SCALAR_HEADS else None
    if not moe and routes is None:
        own_routing(model)
        return _outputs(model, micro, outputs, head, chunk_size, padding_free)
    mask = micro["attention_mask"].bool()
    rows = _packed_rows(mask) if padding_free else torch.arange(mask.numel()).reshape(mask.shape)
    flat = None if routes is None else (routes[mask] if padding_free else routes.flatten(0, 1))
    hooks = RouterHooks.on(model).arm(flat, replay=mode == "rollout", keep_logits=bool(set(moe) - {"routing_flips"}))
    rest = tuple(o for o in outputs if o not in MOE_OUTPUTS) or ("log_probs",)
    out = _outputs(model, micro, rest, head, chunk_size, padding_free)
    return {**{k: v for k, v in out.items() if k in outputs}, **hooks.outputs(model, moe, rows, mask)}


def _packed_rows(mask: torch.Tensor) -> torch.Tensor:
    """``(batch, seq_len)``: each attended position's row in the packed sequence, -1 elsewhere."""
    index = torch.full(mask.shape, -1, dtype=torch.long)
    index[mask] = torch.arange(int(mask.sum()))
    return index


def _outputs(
    model: torch.nn.Module, micro: Batch, outputs: tuple[str, ...], head: str, chunk_size: int | None, padding_free: bool
) -> dict[str, torch.Tensor]:
    if padding_free:
        return packed_outputs(model, micro, outputs, head, chunk_size)
    device = next(model.parameters()).device
    inputs = {k: micro[k].to(device) for k in MODEL_INPUTS}
    inputs.update(
        image_kwargs(model.config, inputs["input_ids"], micro.get(IMAGE_INPUTS), micro["responses"].shape[1] if "responses" in micro else 0)
    )
    if head in SCALAR_HEADS:
        return value_outputs(model(**inputs).logits[..., 0], micro, outputs)
    if "label_log_probs" not in outputs:
        # only the positions that predict response tokens go through the LM head (vocab-wide
        # logits over the prompt would be computed and thrown away)
        inputs["logits_to_keep"] = micro["responses"].shape[1] + 1
    elif "loss_mask" in micro and not set(RESPONSE_OUTPUTS) & set(outputs):
        # supervised rows: only the positions whose next token is in the loss reach the LM head
        where = _label_rows(micro, outputs)
        logits = _logits_where(model, inputs, where)  # (positions kept, vocab)
        labels = micro["input_ids"][:, 1:][where].to(device)
        return {"label_log_probs": _unpack(token_log_probs(logits, labels, chunk_size), where)}
    return lm_outputs(model(**inputs).logits, micro, outputs, chunk_size)
