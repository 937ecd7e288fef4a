"""HF rollout on a tiny model: sample layout, masks, log-probs against a plain forward pass, left
padding, and in-memory weight updates."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.interfaces.rollout import RolloutSpec, SamplingParams
from trellis.interfaces.weights import WeightSyncError
from trellis_hf.engine import HFRolloutOptions, make_engine

TEXTS = ["12+35=", "7+8=", "40+41="]


@pytest.fixture
def engine(tiny_model_path):
    return make_engine(RolloutSpec(tiny_model_path, HFRolloutOptions(), AutoTokenizer.from_pretrained(tiny_model_path)))


def forward_log_probs(model, out, temperature):
    n = out["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]).logits
    logits = logits[:, -n - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)


def test_layout_and_grouping(engine, make_prompts):
    prompts = make_prompts(engine.tokenizer, TEXTS)
    out = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=0))
    assert len(out) == 12
    assert list(out["text"]) == [t for t in TEXTS for _ in range(4)]  # prompt i's samples at 4i..4i+3
    resp_len = out["responses"].shape[1]
    assert resp_len <= 8
    assert out["input_ids"].shape == (12, prompts["input_ids"].shape[1] + resp_len)
    assert torch.equal(out["prompts"], prompts["input_ids"].repeat_interleave(4, 0))
    assert out.meta["temperature"] == 1.0


def test_mask_stops_after_first_eos(engine, make_prompts):
    out = engine.generate(make_prompts(engine.tokenizer, TEXTS), SamplingParams(n=8, max_new_tokens=12, seed=3))
    eos = engine.tokenizer.eos_token_id
    for tokens, mask in zip(out["responses"], out["response_mask"]):
        valid = int(mask.sum())
        assert torch.equal(mask[:valid], torch.ones(valid, dtype=mask.dtype))  # mask is a prefix
        hits = (tokens == eos).nonzero().flatten().tolist()
        if hits:
            assert valid == hits[0] + 1  # includes the first EOS, nothing after
        else:
            assert valid == 12


@pytest.mark.parametrize(
    "params",
    [SamplingParams(n=2, temperature=0.7, max_new_tokens=10, seed=1), SamplingParams(n=2, temperature=1.3, top_k=5, max_new_tokens=10, seed=2),
     SamplingParams(greedy=True, max_new_tokens=10)],
    ids=["t0.7", "t1.3-topk", "greedy"],
)  # fmt: skip
def test_log_probs_equal_forward_at_temperature(engine, make_prompts, tiny_model_path, params):
    """Recorded during generation (one step's log-softmax at a time): equal to a forward pass over
    the sampled tokens, at the sampling temperature (top-k does not renormalise them)."""
    out = engine.generate(make_prompts(engine.tokenizer, TEXTS), params)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    expected = forward_log_probs(model, out, out.meta["temperature"]) * out["response_mask"]
    torch.testing.assert_close(out["rollout_log_probs"], expected, atol=1e-5, rtol=0)


def test_left_padding_does_not_change_greedy_output(engine, make_prompts):
    greedy = SamplingParams(greedy=True, max_new_tokens=8)
    alone = engine.generate(make_prompts(engine.tokenizer, ["7+8="]), greedy)
    batched = engine.generate(make_prompts(engine.tokenizer, TEXTS), greedy)
    n = int(alone["response_mask"][0].sum())
    assert torch.equal(batched["responses"][1, :n], alone["responses"][0, :n])


def test_seeded_sampling_is_reproducible(engine, make_prompts):
    params = SamplingParams(n=3, max_new_tokens=8, seed=42)
    a = engine.generate(make_prompts(engine.tokenizer, TEXTS), params)
    b = engine.generate(make_prompts(engine.tokenizer, TEXTS), params)
    assert torch.equal(a["responses"], b["responses"])


def test_sampling_draws_from_the_engines_generator_never_torchs_default(tiny_model_path, make_prompts):
    """Another thread drawing from torch's default generator (the trainer's, while the engine
    generates ahead of it) cannot move the samples: the engine never draws from it. Engines
    built with one seed sample alike."""
    params = SamplingParams(n=3, max_new_tokens=8)

    def two_calls(draw_between: bool):
        engine = make_engine(RolloutSpec(tiny_model_path, HFRolloutOptions(), AutoTokenizer.from_pretrained(tiny_model_path), seed=5))
        prompts = make_prompts(engine.tokenizer, TEXTS)
        before = torch.get_rng_state()
        first = engine.generate(prompts, params)["responses"]
        assert torch.equal(torch.get_rng_state(), before)
        if draw_between:
            torch.rand(1000)
        return first, engine.generate(prompts, params)["responses"]

    plain, drawn = two_calls(False), two_calls(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, drawn))
    assert not torch.equal(*plain)  # the second call drew on from the first's state


def test_top_k_one_samples_the_greedy_answer(engine, make_prompts):
    prompts = make_prompts(engine.tokenizer, TEXTS)
    greedy = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=8))
    top1 = engine.generate(prompts, SamplingParams(n=1, temperature=1.5, top_k=1, max_new_tokens=8))
    assert torch.equal(top1["responses"], greedy["responses"])


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("fixture", ["tiny_model_path", "tiny_untied_model_path"])
def test_load_weights_makes_outputs_follow_new_weights(fixture, streamed, request, make_prompts):
    path = request.getfixturevalue(fixture)
    engine = make_engine(RolloutSpec(path, HFRolloutOptions(), AutoTokenizer.from_pretrained(path)))
    other = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    state = other.state_dict()
    if streamed:  # read lazily against the manifest (the trainer's weight_shapes)
        engine.load_weights((pair for pair in state.items()), shapes={name: t.shape for name, t in state.items()})
    else:
        engine.load_weights(state.items())
    out = engine.generate(make_prompts(engine.tokenizer, TEXTS), SamplingParams(n=2, max_new_tokens=8, seed=0))
    expected = forward_log_probs(other, out, 1.0) * out["response_mask"]
    torch.testing.assert_close(out["rollout_log_probs"], expected, atol=1e-5, rtol=0)


def test_bad_weight_update_fails_clearly_and_keeps_old_weights(engine, make_prompts):
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    name = "model.layers.0.mlp.up_proj.weight"
    closest = r"unknown parameter 'model.layers.0.mlp.up_projj.weight'; the engine's closest names: \['model.layers.0.mlp.up_proj.weight'"
    with pytest.raises(WeightSyncError, match=closest):
        engine.load_weights([(name, before[name] + 1), ("model.layers.0.mlp.up_projj.weight", before[name])])
    with pytest.raises(WeightSyncError, match=rf"'{name}' has shape \(3, 3\), the engine expects"):
        engine.load_weights([("model.norm.weight", before["model.norm.weight"] + 1), (name, torch.zeros(3, 3))])
    read = []
    stream = (read.append(n) or (n, before[n] + 1) for n in ("model.norm.weight", name))
    with pytest.raises(WeightSyncError, match=rf"'{name}' has shape \(3, 3\), the engine expects"):
        engine.load_weights(stream, shapes={"model.norm.weight": before["model.norm.weight"].shape, name: (3, 3)})
    assert read == []  # a refused manifest: the stream is never read
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused update"
    assert len(engine.generate(make_prompts(engine.tokenizer, TEXTS), SamplingParams(max_new_tokens=4))) == 3


def test_concurrent_agenerate_calls_form_one_batch_with_the_same_results(engine):
    """Requests started together run as one batched generate (left-padded, each cut at its own
    token limit), and greedy results equal those of the requests run one at a time."""
    questions = ["12+35=", "7+1=", "40+15=", "3+3="]
    prompts = [engine.tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
    limits = [6, 3, 6, 1]

    async def together():
        calls = [engine.agenerate(p, SamplingParams(greedy=True, max_new_tokens=m)) for p, m in zip(prompts, limits)]
        return await asyncio.gather(*calls)

    engine.batch_sizes.clear()
    batched = asyncio.run(together())
    assert list(engine.batch_sizes) == [4]
    alone = [asyncio.run(engine.agenerate(p, SamplingParams(greedy=True, max_new_tokens=m))) for p, m in zip(prompts, limits)]
    assert list(engine.batch_sizes) == [4, 1, 1, 1, 1]
    for b, a, m in zip(batched, alone, limits):
        assert b.token_ids == a.token_ids and len(b.token_ids) <= m
        assert b.log_probs == pytest.approx(a.log_probs, abs=1e-4)
        assert b.finish_reason == a.finish_reason


def test_numeric_options_declare_and_enforce_ranges(assert_ranges_enforced):
    from trellis.plugins import load_plugins

    assert assert_ranges_enforced(HFRolloutOptions, load_plugins().registry) == 1


def test_string_options_declare_and_enforce_their_values(assert_choices_enforced):
    from trellis.plugins import load_plugins

    assert assert_choices_enforced(HFRolloutOptions, load_plugins().registry) == 2  # dtype, device


def test_the_default_dtype_follows_the_device() -> None:
    """``rollout.dtype`` null: bfloat16 on a GPU (the trainer computes in bf16 there), float32 on
    CPU; a named dtype is kept on both."""
    from trellis.interfaces.rollout import engine_dtype

    assert engine_dtype(None, on_gpu=True) == "bfloat16" and engine_dtype(None, on_gpu=False) == "float32"
    assert engine_dtype("float16", on_gpu=True) == "float16" and engine_dtype("float32", on_gpu=True) == "float32"


def test_a_generation_that_raises_stop_iteration_fails_its_callers_instead_of_hanging(engine, monkeypatch):
    """StopIteration (transformers raises it for an image slot without an image) cannot be set on a
    future: the callers of that batch would wait forever; they get a RuntimeError."""

    def stop(group):
        raise StopIteration

    monkeypatch.setattr(engine, "_generate_group", stop)

    async def call():
        return await asyncio.wait_for(engine.agenerate([1, 2, 3], SamplingParams(greedy=True, max_new_tokens=2)), 30)

    with pytest.raises(RuntimeError, match="generation failed: StopIteration"):
        asyncio.run(call())


def test_shared_prompts_sample_what_every_row_sampled(tiny_model_path, make_prompts, monkeypatch):
    """Each distinct prompt prefilled once and its KV cache repeated for its n samples (prompts of
    mixed widths, left-padded): the same tokens from the same seed, log-probs equal to rounding."""
    import trellis_hf.engine

    made = []  # the length of each shared cache when made (generate extends it in place)
    real = trellis_hf.engine._shared_prefill

    def spy(*args):
        cache = real(*args)
        made.append(None if cache is None else cache.get_seq_length())
        return cache

    monkeypatch.setattr(trellis_hf.engine, "_shared_prefill", spy)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    outs = []
    for share in (True, False):
        engine = make_engine(RolloutSpec(tiny_model_path, HFRolloutOptions(share_prompts=share), tokenizer))
        outs.append(engine.generate(make_prompts(tokenizer, TEXTS), SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=7)))
    shared, every_row = outs
    assert made == [shared["prompts"].shape[1] - 1]  # made once (the second engine shares nothing), for all but the last prompt token
    assert torch.equal(shared["responses"], every_row["responses"])
    torch.testing.assert_close(shared["rollout_log_probs"], every_row["rollout_log_probs"], atol=1e-5, rtol=0)


def test_shared_prefill_is_skipped_where_no_prompt_repeats(engine, make_prompts):
    from trellis_hf.engine import _shared_prefill

    prompts = make_prompts(engine.tokenizer, TEXTS)
    assert _shared_prefill(engine.model, prompts["input_ids"], prompts["attention_mask"]) is None
    one_token = prompts["input_ids"][:, -1:].repeat(2, 1)
    assert _shared_prefill(engine.model, one_token, torch.ones_like(one_token)) is None
