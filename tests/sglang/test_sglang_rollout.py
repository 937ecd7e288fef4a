"""The SGLang rollout against the real engine on a tiny model: the HF rollout's layout, log-probs equal
to the FSDP actor's, weight sync in buckets (tied and untied), refused syncs, async generation,
sleep on CPU.

One engine per model for the whole module (start-up takes 30-50 s on CPU)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.interfaces.rollout import RolloutSpec, SamplingParams
from trellis.interfaces.weights import WeightSyncError
from trellis_sglang import SGLangRolloutOptions, make_engine

TEXTS = ["12+35=", "7+8=", "40+41="]
LONG = ["".join(f"{a}+{a}={2 * a} #### {2 * a}\n" for a in range(10, 30)) + "12+13="]  # a long shared prefix: radix-cached


def build(path, **options):
    return make_engine(RolloutSpec(path, SGLangRolloutOptions(**options), AutoTokenizer.from_pretrained(path)))


@pytest.fixture(scope="module")
def engines(tiny_model_path, tiny_untied_model_path):
    """Both engines, closed at the end of the module."""
    built = {"tied": build(tiny_model_path), "untied": build(tiny_untied_model_path, sync_bucket_mb=0.01)}
    yield built
    for eng in built.values():
        eng.close()


@pytest.fixture(scope="module")
def engine(engines):
    return engines["tied"]


@pytest.fixture
def restore():
    """Load the checkpoint's weights back into the engines a test changed."""
    changed = []
    yield changed.append
    for eng in changed:
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
    out = engine.generate(prompts, SamplingParams(n=4, temperature=0.9, max_new_tokens=8))
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
    stop = int(greedy(engine, make_prompts, n_tokens=12)["responses"][0, 2])  # make a token prompt 0 meets a stop token
    sampled = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=12, stop_token_ids=[stop]))
    stopped = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=12, stop_token_ids=[stop]))
    stops = engine.eos_ids | {stop}
    ended = 0
    for out in (sampled, stopped):
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
    assert int(stopped["response_mask"][0].sum()) <= 3 and ended >= 1


def test_left_padding_does_not_change_greedy_outputs(engine, make_prompts):
    alone = greedy(engine, make_prompts, ["7+8="])
    batched = greedy(engine, make_prompts)
    n = int(alone["response_mask"][0].sum())
    assert torch.equal(batched["responses"][1, :n], alone["responses"][0, :n])


# -- log-probs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(n=3, temperature=0.7, max_new_tokens=10), SamplingParams(greedy=True, max_new_tokens=10)])
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
def test_outputs_and_log_probs_follow_synced_weights(tied, engines, make_prompts, restore):
    eng = engines["tied" if tied else "untied"]  # the untied engine syncs in 10 KiB buckets: many calls
    prompts = make_prompts(eng.tokenizer, TEXTS + LONG)
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=8)
    eng.generate(prompts, params)  # fills the radix cache with the old weights' KV
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
    params = SamplingParams(n=4, max_new_tokens=8)
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
    with pytest.raises(WeightSyncError, match=r"'model.norm.weight' has dtype torch.int64; the engine's weights are floating point"):
        engine.load_weights([("model.norm.weight", state["model.norm.weight"].long())])
    with pytest.raises(WeightSyncError, match="given twice"):
        engine.load_weights([(name, state[name]), (name, state[name])])
    after = greedy(engine, make_prompts)
    assert torch.equal(after["responses"], before["responses"])
    torch.testing.assert_close(after["rollout_log_probs"], before["rollout_log_probs"], atol=1e-6, rtol=0)  # radix-cached prefix: float noise


# -- async, sleep, options ------------------------------------------------------------------------
def test_agenerate_runs_concurrent_samples_from_any_event_loop(engine, make_prompts):
    ids = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    params = SamplingParams(greedy=True, max_new_tokens=6)

    async def run():
        return await asyncio.gather(*[engine.agenerate(x, params) for x in ids + ids])

    ref = greedy(engine, make_prompts, n_tokens=6)
    for gens in (asyncio.run(run()), asyncio.run(run())):  # two event loops, one after the other
        for i, g in enumerate(gens):
            n = int(ref["response_mask"][i % 3].sum())
            assert g.token_ids == ref["responses"][i % 3, :n].tolist()
            torch.testing.assert_close(torch.tensor(g.log_probs), ref["rollout_log_probs"][i % 3, :n], atol=1e-5, rtol=0)
            assert g.finish_reason == ("stop" if g.token_ids[-1] in engine.eos_ids else "length")


def test_cancelled_agenerate_is_aborted_and_others_finish(engine, make_prompts):
    ids = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]

    async def run():
        slow = asyncio.ensure_future(engine.agenerate(ids[0], SamplingParams(greedy=True, max_new_tokens=400)))
        fast = asyncio.ensure_future(engine.agenerate(ids[1], SamplingParams(greedy=True, max_new_tokens=4)))
        await asyncio.sleep(0.2)
        slow.cancel()
        return await fast, slow

    fast, slow = asyncio.run(run())
    assert slow.cancelled() and 1 <= len(fast.token_ids) <= 4
    assert len(greedy(engine, make_prompts)) == 3


def test_sleep_on_cpu_says_so_once_and_carries_on(engine, make_prompts, caplog):
    if not engine.on_cpu:
        pytest.skip("memory release works on GPU")
    with caplog.at_level(logging.WARNING, logger="trellis"):
        for _ in range(2):
            engine.sleep()
            engine.wake()
    said = [r for r in caplog.records if "sleep/wake is unsupported on CPU" in r.getMessage()]
    assert len(said) <= 1  # once per process (an earlier test may have said it already)
    assert not engine.asleep
    assert len(greedy(engine, make_prompts)) == 3


def test_bad_options_fail_with_the_option_name(tiny_model_path):
    for options, message in [
        ({"dtype": "fp32"}, r"rollout.dtype='fp32' is not a dtype"),
        ({"tensor_parallel_size": 2}, r"rollout.tensor_parallel_size=2: .* set rollout.tensor_parallel_size=1"),
        ({"sync_bucket_mb": 0}, r"rollout.sync_bucket_mb=0 must be positive"),
    ]:
        with pytest.raises(ValueError, match=message):
            build(tiny_model_path, **options)


def test_numeric_options_declare_and_enforce_ranges(assert_ranges_enforced):
    from trellis.plugins import load_plugins

    assert assert_ranges_enforced(SGLangRolloutOptions, load_plugins().registry) == 7


def test_plugin_registers_the_sglang_rollout_with_its_options():
    from trellis.plugins import load_plugins

    entry = load_plugins().registry.get("rollout", "sglang")
    assert entry.obj is make_engine and entry.options is SGLangRolloutOptions


def test_closing_one_engine_leaves_the_other_generating(engines, make_prompts):
    """SGLang's own shutdown ends every child process of this process (and a watchdog then kills
    the process): ``close`` ends only the engine's own."""
    engines["untied"].close()
    assert len(greedy(engines["tied"], make_prompts)) == 3
