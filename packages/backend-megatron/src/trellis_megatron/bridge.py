"""Hugging Face <-> Megatron-Core: a ``GPTModel`` (local layer spec) from an HF config, and weights
both ways through mbridge's name mapping and fused-tensor layout (QKV, gate/up), split over and
gathered from the tensor-parallel ranks here.

mbridge's own bridges build Transformer-Engine layers and read ``rope_theta`` where transformers 5
no longer keeps it; the subclasses below swap in Megatron's local (pure PyTorch) layer spec and
read the RoPE base from ``rope_parameters``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from mbridge.models.llama import LLaMABridge
from mbridge.models.qwen2 import Qwen2Bridge
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec


class _LocalSpec:
    """Mixin for an mbridge bridge: Megatron's local layers (their norms are modules of their own,
    not fused into the next linear layer), RoPE base from ``rope_parameters``."""

    _OTHER_MAPPING = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._MLP_MAPPING = {"pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"], **cls._MLP_MAPPING}

    def _get_transformer_layer_spec(self, vp_stage=None):
        return get_gpt_layer_local_spec(qk_layernorm=self.config.qk_layernorm, normalization="RMSNorm")

    def _adjust_mapping_for_shared_weights(self):
        # mbridge edits the class's mapping in place for tied models; keep the edit per instance
        self._DIRECT_MAPPING = dict(type(self)._DIRECT_MAPPING)
        super()._adjust_mapping_for_shared_weights()

    def _get_gptmodel_args(self) -> dict:
        hf = self.hf_config
        rope = getattr(hf, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"model rope_parameters.rope_type={rope['rope_type']!r} is not supported by the megatron backend; only 'default' RoPE")
        base = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        return {
            "vocab_size": hf.vocab_size,
            "max_sequence_length": hf.max_position_embeddings,
            "position_embedding_type": "rope",
            "rotary_base": base,
        }


class Qwen2Local(_LocalSpec, Qwen2Bridge):
    """Qwen2 (QKV bias) on local layers."""


class LlamaLocal(_LocalSpec, LLaMABridge):
    """Llama (optional attention bias) on local layers."""


BRIDGES = {"qwen2": Qwen2Local, "llama": LlamaLocal}


def make_bridge(hf_config, dtype: torch.dtype, vocab_multiple: int, **overrides):
    """The bridge of ``hf_config``'s family, its vocabulary padded to a multiple of
    ``vocab_multiple``; ``overrides`` go into Megatron's ``TransformerConfig``."""
    cls = BRIDGES.get(hf_config.model_type)
    if cls is None:
        raise ValueError(
            f"model.path has model_type={hf_config.model_type!r}, which the megatron backend cannot build; "
            f"supported: {', '.join(sorted(BRIDGES))} (or use backend.name=fsdp)"
        )
    bridge = cls(hf_config, dtype=dtype, make_vocab_size_divisible_by=vocab_multiple)
    bridge.set_extra_args(**overrides)
    return bridge


def build_gpt(bridge, head: str, seed: int) -> GPTModel:
    """This pipeline stage's ``GPTModel``. ``head="value"``: the LM head is replaced by a
    one-output linear layer (:class:`ValueHead`, HF names ``score.weight``, ``score.bias``), its weight drawn from
    ``N(0, initializer_range)`` with ``seed`` (the same on every rank) until weights replace it."""
    pre, post = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    model = bridge._model_provider([])(pre_process=pre, post_process=post)
    if head == "value" and post:
        model.share_embeddings_and_output_weights = False
        model.output_layer = ValueHead(bridge.config.hidden_size, bridge.dtype)
        std = getattr(bridge.hf_config, "initializer_range", 0.02)
        with torch.no_grad():
            model.output_layer.weight.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
    return model


class ValueHead(torch.nn.Module):
    """One value per position (a linear layer with bias, as transformers' token-classification
    head, without its dropout), replicated on every tensor-parallel rank (its input is the full
    hidden state there), called like Megatron's output layer: ``(hidden, **_) -> (values, None)``
    with values ``(seq, batch, 1)``."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def _hf_names(bridge, model) -> dict[str, list[str]]:
    """Local parameter name -> the HF names it is made of (global layer numbers)."""
    local_to_global = bridge._weight_name_mapping_mcore_local_to_global(model)
    out = {}
    for local, global_name in local_to_global.items():
        if "_extra_state" in local:
            continue
        if _is_value_head(model, local):
            out[local] = [local.replace("output_layer.", "score.")]
        else:
            out[local] = bridge._weight_name_mapping_mcore_to_hf(global_name)
    return out


def _is_value_head(model, name: str | None) -> bool:
    return name in ("output_layer.weight", "output_layer.bias") and isinstance(getattr(model, "output_layer", None), ValueHead)


def load_hf(bridge, model, tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], optional: tuple[str, ...] = ()) -> None:
    """Copy full HF tensors into this rank's shards. Every rank holds (or reads) every tensor it
    needs and keeps its own tensor-parallel slice, so no collective is needed. Raises on a
    missing tensor unless its HF name is in ``optional`` (the parameter keeps its value)."""
    tensors = tensors if isinstance(tensors, dict) else dict(tensors)
    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    state = model.state_dict()
    with torch.no_grad():
        for local, names in _hf_names(bridge, model).items():
            if local == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights", False) and "lm_head.weight" not in tensors:
                names = ["model.embed_tokens.weight"]  # tied: the head is the embedding
            missing = [n for n in names if n not in tensors]
            if missing and set(missing) <= set(optional):
                continue
            if missing:
                raise KeyError(f"weights lack {missing} for the megatron parameter {local}")
            param = state[local]
            if _is_value_head(model, local):  # replicated, not vocabulary-sized
                shard = tensors[names[0]]
            else:
                full = bridge._weight_to_mcore_format(local, [tensors[n] for n in names])
                shard = bridge._weight_split_across_tp(local, full, param, tp)[tp_rank] if tp > 1 else full
            param.copy_(shard.to(param.dtype))


def _exported_params(bridge, model) -> list[tuple[str, torch.nn.Parameter]]:
    """This stage's parameters in export order; the last stage's copy of a tied embedding is
    left out (the first stage's is exported)."""
    tied = bool(getattr(bridge.hf_config, "tie_word_embeddings", False))
    return [(n, p) for n, p in model.named_parameters() if not (tied and n == "output_layer.weight" and not _is_value_head(model, n))]


def hf_shapes(bridge, model) -> dict[str, tuple[int, ...]]:
    """HF name -> full shape of every tensor :func:`export_hf` yields, in its order, from the
    shards' shapes alone (only names and shapes cross the pipeline stages)."""
    tp = mpu.get_tensor_model_parallel_world_size()
    local_to_global = bridge._weight_name_mapping_mcore_local_to_global(model)
    mine = []
    for local, param in _exported_params(bridge, model):
        shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            shape[param.partition_dim] *= tp
        mine.append((local_to_global[local], _is_value_head(model, local), shape))
    stages: list = [None] * mpu.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, mine, group=mpu.get_pipeline_model_parallel_group())
    shapes = {}
    for name, value_head, shape in (entry for stage in stages for entry in stage):
        if value_head:
            shapes[name.replace("output_layer.", "score.")] = tuple(shape)
            continue
        # the HF layout of a full tensor of that shape, worked out on the meta device
        for hf_name, value in zip(*bridge._weight_to_hf_format(name, torch.empty(shape, device="meta"))):
            shapes[hf_name] = tuple(value.shape)
    return shapes


def export_hf(bridge, model, to_cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors under HF names, gathered over the tensor-parallel group and broadcast from
    the pipeline stage that holds each (every rank of the model-parallel group must iterate it
    to the end; every rank gets every tensor), copies on the CPU or (``to_cpu=False``) on the
    model's device. Tied embeddings yield no ``lm_head.weight``."""
    from mbridge.core.util import broadcast_from_megatron_pp, broadcast_str_from_megatron_pp

    local_to_global = bridge._weight_name_mapping_mcore_local_to_global(model)
    params = _exported_params(bridge, model)
    # every stage learns how many parameters each stage holds
    counts: list = [None] * mpu.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(counts, len(params), group=mpu.get_pipeline_model_parallel_group())
    mine = iter(params)
    tp, tp_group = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_group()
    with torch.no_grad():
        for stage, count in enumerate(counts):
            for _ in range(count):
                local, param = next(mine) if stage == mpu.get_pipeline_model_parallel_rank() else (None, None)
                key = (local_to_global[local], _is_value_head(model, local)) if local is not None else None
                name, value_head = broadcast_str_from_megatron_pp(key)
                tensor = broadcast_from_megatron_pp(param)
                if value_head:
                    yield name.replace("output_layer.", "score."), _copy(tensor, to_cpu)
                    continue
                if getattr(tensor, "tensor_model_parallel", False) and tp > 1:
                    parts = [torch.empty_like(tensor) for _ in range(tp)]
                    dist.all_gather(parts, tensor.contiguous(), group=tp_group)
                    tensor = bridge._weight_merge_across_tp(name, parts, tensor)
                for hf_name, value in zip(*bridge._weight_to_hf_format(name, tensor)):
                    yield hf_name, _copy(value, to_cpu)


def _copy(tensor: torch.Tensor, to_cpu: bool) -> torch.Tensor:
    """A copy that shares no memory with the model's parameters, on the CPU or where it is."""
    return tensor.detach().to("cpu" if to_cpu else tensor.device, copy=True)
