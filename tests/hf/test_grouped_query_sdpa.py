"""Grouped-query attention in one sdpa call on CPU (``grouped_query_sdpa``): building a model turns
it on unless the environment says otherwise, and a GQA model gives the same log-probs, gradients
and greedy generations with it as with transformers' default (keys and values copied per head)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from transformers import AutoTokenizer

from trellis.interfaces.hf import SDPA_GQA, load_hf_model
from trellis.interfaces.rollout import RolloutSpec
from trellis_hf.engine import HFRolloutOptions, make_engine


@pytest.fixture
def model(tiny_model_path):
    model = load_hf_model(tiny_model_path, "lm", torch.float32)
    config = model.config
    assert config.num_key_value_heads < config.num_attention_heads  # the tiny model is a GQA model
    return model


def test_building_a_model_or_an_engine_turns_it_on_unless_the_environment_sets_it(tiny_model_path, monkeypatch):
    expected = None if torch.cuda.is_available() else "1"  # left alone where CUDA is: its fused kernels take no mask with GQA
    monkeypatch.delenv(SDPA_GQA, raising=False)
    load_hf_model(tiny_model_path, "lm", torch.float32)
    assert os.environ.get(SDPA_GQA) == expected
    monkeypatch.delenv(SDPA_GQA, raising=False)
    engine = make_engine(RolloutSpec(tiny_model_path, HFRolloutOptions(), AutoTokenizer.from_pretrained(tiny_model_path)))
    assert engine.model is not None and os.environ.get(SDPA_GQA) == expected
    monkeypatch.setenv(SDPA_GQA, "0")  # a user's own choice stays
    load_hf_model(tiny_model_path, "lm", torch.float32)
    assert os.environ[SDPA_GQA] == "0"


def _reads_the_switch(monkeypatch) -> bool:
    """Whether this transformers reads ``TRANSFORMERS_SDPA_FORCE_GQA`` (5.23 on)."""
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

    monkeypatch.setenv(SDPA_GQA, "1")
    t = torch.zeros(1, 1, 1, 1)
    return use_gqa_in_sdpa(t.bool(), t, t)


def _spy_gqa(monkeypatch) -> list[bool]:
    """Record whether each sdpa call got ``enable_gqa=True``."""
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(bool(kwargs.get("enable_gqa")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def _padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4], mask[2, :2] = 0, 0  # left padding: sdpa gets a mask
    return ids, mask


@pytest.mark.skipif(torch.cuda.is_available(), reason="the switch is for CPU's kernels")
def test_same_log_probs_gradients_and_generations_as_the_copied_heads(model, monkeypatch):
    if not _reads_the_switch(monkeypatch):
        pytest.skip(f"transformers {transformers.__version__} reads no {SDPA_GQA} (5.23 on): nothing to compare")
    ids, mask = _padded_batch(model.config.vocab_size)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    results, calls = {}, _spy_gqa(monkeypatch)
    for switch in ("0", "1"):
        monkeypatch.setenv(SDPA_GQA, switch)
        calls.clear()
        model.zero_grad()
        log_probs = torch.log_softmax(model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1], -1)
        log_probs = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]
        log_probs.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=0,
                                 use_cache=True, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        assert set(calls) == {switch == "1"}  # every attention call took the path asked for
        results[switch] = (log_probs.detach(), grads, out.sequences, torch.stack(out.logits))
    (lp0, g0, seq0, logits0), (lp1, g1, seq1, logits1) = results["0"], results["1"]
    torch.testing.assert_close(lp1, lp0, atol=1e-6, rtol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert torch.equal(seq1, seq0)
    torch.testing.assert_close(logits1, logits0, atol=1e-5, rtol=1e-5)
