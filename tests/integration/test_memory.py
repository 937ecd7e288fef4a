"""The activation-memory estimate of a role's update and the warning the rl recipe's check gives on
CUDA (taken here on CPU by patching torch's device queries). Here, not in tests/core: the rl
check resolves the default policy loss (trellis-algos) and the FSDP backend's options."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from trellis import config as config_mod
from trellis.plugins import load_plugins
from trellis_algos import rl
from trellis_algos.rl.memory import ModelShape, activation_bytes

# Qwen2.5-7B's sizes; verl's GRPO seq-balance example: 512-token prompts, 1024-token responses,
# ppo_max_token_len_per_gpu=24000
SEVEN_B = {
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
}
GIB_80 = 80 * 10**9


def write_model(path, **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_estimate_follows_the_per_layer_count(tmp_path):
    model = write_model(
        tmp_path / "m", hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16, vocab_size=10
    )
    shape = ModelShape.read(model)
    assert shape == ModelShape(layers=2, hidden=8, kv_hidden=4, intermediate=16, vocab=10)  # head size 8 / 2 heads = 4
    # a layer keeps 7*8 + 2*4 + 4*16 = 128 values per token; 10 tokens x 2 layers, 4 logit rows x 10, 2 bytes each
    assert activation_bytes(shape, tokens=10, logit_tokens=4, value_bytes=2, checkpointing=False) == (10 * 2 * 128 + 40) * 2
    # checkpointed: each layer's input (8) per layer, plus one layer recomputed (128)
    assert activation_bytes(shape, 10, 4, 2, checkpointing=True) == (10 * (2 * 8 + 128) + 40) * 2
    assert activation_bytes(shape, 10, 4, 2, checkpointing=False, packed=True) == 5200 + 10 * 10  # a (10, 10) bool mask
    assert activation_bytes(shape, 10, 4, 2, checkpointing=False, tp=2) == 5200 // 2


def test_config_without_sizes_gives_no_shape(tmp_path):
    assert ModelShape.read(tmp_path) is None  # no config.json
    assert ModelShape.read(write_model(tmp_path / "m", hidden_size=8)) is None


@pytest.fixture
def on_cuda(monkeypatch):
    """torch reports one CUDA device of 80 GB (10^9 bytes)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=GIB_80, name="an 80 GB GPU"))


@pytest.fixture
def seven_b_check(tmp_path):
    """``check(*overrides)``: the rl recipe's check on a 7B-shaped model at verl's GRPO lengths;
    returns the activation-memory warnings it logged."""
    model = write_model(tmp_path / "qwen7b", **SEVEN_B)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1"}], "data_source": "gsm8k"}) + "\n")
    registry = load_plugins().registry
    base = [
        f"model.path={model}",
        f"data.train_path={data}",
        "reward.name=gsm8k",
        "recipe=rl",
        "data.max_prompt_length=512",
        "sampling.max_new_tokens=1024",
    ]

    def check(*overrides):
        cfg = config_mod.compose(None, base + list(overrides), registry)
        handler = _Lines()
        logging.getLogger("trellis").addHandler(handler)
        try:
            rl.check(cfg, registry)
        finally:
            logging.getLogger("trellis").removeHandler(handler)
        return [line for line in handler.lines if "activations" in line]

    return check


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_verl_7b_token_budget_warns_on_80gb_without_checkpointing(on_cuda, seven_b_check):
    (line,) = seven_b_check("actor.max_tokens_per_micro_batch=24000")
    # 28 layers x (7*3584 + 2*512 + 4*18944) values x 24000 tokens + 16000 logit rows x 152064, 2 bytes each
    need = (24000 * 28 * 101888 + 16000 * 152064) * 2
    assert f"at least {need / 2**30:.1f} GiB" in line and "bfloat16" in line and "an 80 GB GPU" in line
    assert "backend.activation_checkpointing=true" in line and "actor.max_tokens_per_micro_batch (now 24000)" in line
    fits = int(line.split("to ")[-1].split(" or less")[0])
    assert 0 < fits < 24000
    assert seven_b_check(f"actor.max_tokens_per_micro_batch={fits}") == []  # the budget it proposes fits
    assert seven_b_check(f"actor.max_tokens_per_micro_batch={fits + 1}") != []


def test_checkpointing_fits_the_verl_budget(on_cuda, seven_b_check):
    assert seven_b_check("actor.max_tokens_per_micro_batch=24000", "backend.activation_checkpointing=true") == []


def test_sample_batches_name_micro_batch_samples(on_cuda, seven_b_check):
    (line,) = seven_b_check("actor.micro_batch_samples=16")  # 16 x 1536 tokens
    assert "a micro-batch of 24576 tokens" in line and "actor.micro_batch_samples (now 16)" in line


def test_no_estimate_on_cpu(monkeypatch, seven_b_check):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert seven_b_check("actor.max_tokens_per_micro_batch=24000") == []
