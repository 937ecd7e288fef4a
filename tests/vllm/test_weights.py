"""The checks a weight update passes before vLLM sees it (no engine needed), and the plugin."""

from __future__ import annotations

import pytest
import torch

from trellis.interfaces.weights import DEFAULT_PACKED, WeightSyncError, check_update, checkpoint_shapes, complete_tied, group_of, tied_pairs

EXPECTED = {
    "model.embed_tokens.weight": (10, 4),
    "model.layers.0.self_attn.q_proj.weight": (4, 4),
    "model.layers.0.self_attn.k_proj.weight": (2, 4),
    "model.layers.0.self_attn.v_proj.weight": (2, 4),
    "model.layers.0.self_attn.q_proj.bias": (4,),
    "model.layers.0.self_attn.k_proj.bias": (2,),
    "model.layers.0.self_attn.v_proj.bias": (2,),
    "model.layers.0.mlp.gate_proj.weight": (8, 4),
    "model.layers.0.mlp.up_proj.weight": (8, 4),
    "model.layers.0.mlp.down_proj.weight": (4, 8),
    "model.norm.weight": (4,),
    "lm_head.weight": (10, 4),
}


def full(names=EXPECTED):
    return [(n, torch.zeros(EXPECTED[n])) for n in names]


def test_group_of_maps_shards_to_fused_modules():
    assert group_of("model.layers.0.self_attn.k_proj.bias", DEFAULT_PACKED) == "model.layers.0.self_attn.qkv_proj"
    assert group_of("model.layers.0.mlp.up_proj.weight", DEFAULT_PACKED) == "model.layers.0.mlp.gate_up_proj"
    assert group_of("model.layers.0.mlp.down_proj.weight", DEFAULT_PACKED) == "model.layers.0.mlp.down_proj"
    assert group_of("lm_head.weight", DEFAULT_PACKED) == "lm_head"


def test_a_whole_update_and_whole_modules_pass():
    assert len(check_update(full(), EXPECTED)) == len(EXPECTED)
    mlp = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    assert [n for n, _ in check_update(iter(full(mlp)), EXPECTED)] == mlp  # any iterable, returned as a list


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ([("model.norm.weigth", torch.zeros(4))], r"unknown parameter 'model.norm.weigth'; the engine's closest names: \['model.norm.weight'"),
        ([("model.norm.weight", torch.zeros(5))], r"'model.norm.weight' has shape \(5,\), the engine expects \(4,\)"),
        ([("model.norm.weight", [0.0] * 4)], r"'model.norm.weight' is a list, not a tensor"),
        ([("model.norm.weight", torch.zeros(4))] * 2, r"'model.norm.weight' is given twice"),
        (
            [("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 4))],
            r"module 'model.layers.0.self_attn.qkv_proj' is updated only in part; missing \['model.layers.0.self_attn.k_proj.weight'",
        ),
    ],
    ids=["unknown", "shape", "not-a-tensor", "twice", "partial-fused"],
)
def test_bad_updates_are_refused_with_the_reason(update, message):
    with pytest.raises(WeightSyncError, match=message):
        check_update(update, EXPECTED)
    assert issubclass(WeightSyncError, ValueError)


def test_tied_embeddings_are_completed_both_ways_right_after_their_half():
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    embed, norm = torch.ones(10, 4), torch.ones(4)

    def completed(items):
        return list(complete_tied(items, tied, [n for n, _ in items]))

    assert completed([("model.embed_tokens.weight", embed), ("model.norm.weight", norm)]) == [
        ("model.embed_tokens.weight", embed), ("lm_head.weight", embed), ("model.norm.weight", norm)]  # fmt: skip
    assert completed([("lm_head.weight", embed)]) == [("lm_head.weight", embed), ("model.embed_tokens.weight", embed)]
    both = [("model.embed_tokens.weight", embed), ("lm_head.weight", embed)]
    assert completed(both) == both
    assert list(complete_tied(both[:1], {}, ["model.embed_tokens.weight"])) == both[:1]
    manifest = {"model.embed_tokens.weight": (10, 4)}  # a manifest completes the same way
    assert list(complete_tied(manifest.items(), tied, manifest)) == [("model.embed_tokens.weight", (10, 4)), ("lm_head.weight", (10, 4))]


def test_shapes_and_ties_come_from_the_model_folder(tiny_model_path, tiny_untied_model_path):
    from transformers import AutoConfig

    shapes = checkpoint_shapes(tiny_model_path)
    assert shapes["model.layers.0.mlp.up_proj.weight"] == (128, 32)
    assert "lm_head.weight" not in shapes  # a tied checkpoint stores the embedding once
    assert tied_pairs(AutoConfig.from_pretrained(tiny_model_path)) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" in checkpoint_shapes(tiny_untied_model_path)
    assert tied_pairs(AutoConfig.from_pretrained(tiny_untied_model_path)) == {}


def test_plugin_registers_the_vllm_rollout_with_its_options():
    from trellis.plugins import load_plugins
    from trellis_vllm import VLLMRolloutOptions, make_engine

    entry = load_plugins().registry.get("rollout", "vllm")
    assert entry.obj is make_engine and entry.options is VLLMRolloutOptions
