"""LoRA on the FSDP backend (``actor.adapter``): only the adapter trains, the merged export is the
adapted model in plain Hugging Face names, ``base_log_probs`` is the base model, a config that
trains nothing is refused, and checkpoints (adapter and optimizer state only) resume exactly."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_fsdp_worker import OBJECTIVES, actor_options, make_worker, prepared_batch, reference_log_probs
from transformers import AutoModelForCausalLM

from trellis.plugins import load_plugins
from trellis_plain import PlainBackend

ADAPTER = {"rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


def lora_actor(registry, path, adapter=None, **opts):
    options = actor_options(registry, adapter=adapter or ADAPTER)
    return make_worker(registry, path, "actor", options, OBJECTIVES["actor"], **opts)


def exported(worker) -> dict[str, torch.Tensor]:
    return dict(b for bucket in worker.export_weights() for b in bucket)


def plain_model(path: str, weights: dict[str, torch.Tensor] | None = None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    if weights is not None:
        model.load_state_dict(weights)
    return model


def test_only_the_adapter_trains_and_the_run_says_how_much(registry, tiny_model_path, caplog):
    batch = prepared_batch(tiny_model_path)
    with caplog.at_level(logging.INFO, logger="trellis"):
        worker = lora_actor(registry, tiny_model_path)
    params = dict(worker.backend.model.named_parameters())
    adapter = {n for n in params if ".lora_A." in n or ".lora_B." in n}
    # all-linear on 2 Qwen2 layers: q, k, v, o, gate, up, down = 7 layers each, A and B each
    assert len(adapter) == 2 * 7 * 2
    assert {n for n, p in params.items() if p.requires_grad} == adapter
    trained, total = sum(params[n].numel() for n in adapter), sum(p.numel() for p in params.values())
    assert f"actor: {trained} of {total} parameters train" in caplog.text

    before = {n: p.detach().clone() for n, p in params.items()}
    for _ in range(2):  # B starts at 0, so A's gradient is 0 in the first step
        worker.train("update", batch)
    # optimizer state for the adapter's tensors alone
    assert {id(p) for p in worker.backend.optimizer.state} == {id(params[n]) for n in adapter}
    for name, p in params.items():
        if name in adapter:
            assert not torch.equal(p, before[name]), f"{name} did not train"
        else:
            assert torch.equal(p, before[name]), f"base weight {name} changed"


def test_the_merged_export_is_the_adapted_model_in_plain_names(registry, tiny_model_path):
    batch = prepared_batch(tiny_model_path)
    worker = lora_actor(registry, tiny_model_path)
    for _ in range(2):
        worker.train("update", batch)
    weights = exported(worker)
    plain = plain_model(tiny_model_path)
    assert set(weights) == set(plain.state_dict())  # no base_layer / lora_A / lora_B names
    assert worker.weight_shapes() == {n: tuple(t.shape) for n, t in weights.items()}
    merged = plain_model(tiny_model_path, weights)
    with torch.no_grad():
        expected = reference_log_probs(merged, batch) * batch["response_mask"]
        base = reference_log_probs(plain, batch) * batch["response_mask"]
    adapted = worker.log_prob(batch)["log_probs"]
    torch.testing.assert_close(adapted, expected, atol=1e-5, rtol=0)
    assert (adapted - base).abs().max() > 1e-3  # the adapter moved the policy: the check above has teeth


def test_base_log_probs_are_the_base_model(registry, tiny_model_path):
    batch = prepared_batch(tiny_model_path)
    worker = lora_actor(registry, tiny_model_path)
    assert "base_log_probs" in worker.backend.outputs
    for _ in range(2):
        worker.train("update", batch)
    with torch.no_grad():
        base = reference_log_probs(plain_model(tiny_model_path), batch) * batch["response_mask"]
    out = worker.forward(batch, ("log_probs", "base_log_probs"))
    torch.testing.assert_close(out["base_log_probs"], base, atol=1e-6, rtol=0)
    assert (out["log_probs"] - base).abs().max() > 1e-3
    # the adapter is back on after the base forward
    torch.testing.assert_close(worker.log_prob(batch)["log_probs"], out["log_probs"], atol=0, rtol=0)


def test_the_sharded_path_merges_too(registry, tiny_model_path):
    """bfloat16 compute makes one rank shard (FSDP2 DTensors): the adapter trains, the export
    gathers and merges it."""
    batch = prepared_batch(tiny_model_path)
    worker = lora_actor(registry, tiny_model_path, param_dtype="bfloat16")
    assert worker.backend.sharded
    worker.train("update", batch)
    worker.train("update", batch)
    weights = exported(worker)
    original = plain_model(tiny_model_path).state_dict()
    assert set(weights) == set(original)
    assert torch.equal(weights["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    moved = [n for n in weights if not torch.equal(weights[n], original[n])]
    assert moved and all(n.endswith("proj.weight") for n in moved)
    with torch.no_grad():
        expected = reference_log_probs(plain_model(tiny_model_path, weights), batch) * batch["response_mask"]
    torch.testing.assert_close(worker.log_prob(batch)["log_probs"], expected, atol=0.05, rtol=0)  # bf16 compute
    config, alone = worker.export_adapter()  # the adapter alone, gathered whole under PEFT's names
    hidden = original["model.embed_tokens.weight"].shape[1]
    assert type(alone["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]) is torch.Tensor
    assert alone["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, hidden)
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and "q_proj" in config["target_modules"]


def test_a_config_that_trains_nothing_is_refused(registry, tiny_model_path):
    with pytest.raises(ValueError, match=r"config key 'actor.adapter.target_modules'=\['no_such_layer'\].*q_proj"):
        lora_actor(registry, tiny_model_path, {"rank": 4, "target_modules": ["no_such_layer"]})
    refused = r"config key 'actor.adapter.rank'=4: backend PlainBackend trains full weights only; set actor.adapter.rank=0"
    with pytest.raises(ValueError, match=refused):
        lora_actor(registry, tiny_model_path, backend=PlainBackend)


def test_checkpoints_hold_the_adapter_and_resume_exactly(registry, tiny_model_path, tmp_path):
    batch = prepared_batch(tiny_model_path)
    worker = lora_actor(registry, tiny_model_path)
    worker.train("update", batch)
    worker.save(tmp_path / "ckpt")
    worker.train("update", batch)
    expected = exported(worker)

    saved = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys

    resumed = lora_actor(registry, tiny_model_path)
    resumed.load(tmp_path / "ckpt")
    resumed.train("update", batch)
    for name, tensor in exported(resumed).items():
        assert torch.equal(tensor, expected[name]), name
