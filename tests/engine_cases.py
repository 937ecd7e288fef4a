"""Tests every in-process rollout engine (vLLM, SGLang) must pass, against the real engine on a tiny
model:
- the HF rollout's layout, log-probs equal to the FSDP actor's, weight sync (tied and untied; a
  list, or a stream with its manifest as the controllers send it), refused syncs and manifests,
  async generation, sleep on CPU, close (:class:`RolloutCases`);
- multi-turn conversations through the agent loop (:class:`MultiTurnCases`);
- the rl recipe under Ray with the engine in the actor's rank and in a rollout pool of its own
  (:class:`OnRayCases`; the HF engine's pool tests use the same checks);
- the engine as a judge model the rl recipe serves over real HTTP (:func:`check_judge_engine`);
- the engine fed by the Megatron backend (:func:`check_megatron_equals_fsdp`).

An engine's test module subclasses the classes and names the engine (``ENGINE``, ``ENGINE_KEYS``);
the engine is found through the plugin registry, so this module imports no engine and each nox
session runs it with the one engine it installed. One engine per model per
class (start-up: seconds for vLLM, 30-50 s for SGLang on CPU).
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from typing import Any, ClassVar

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.interfaces.rollout import RolloutSpec, SamplingParams
from trellis.interfaces.weights import WeightSyncError
from trellis.runtime.controller import sync_from

TEXTS = ["12+35=", "7+8=", "40+41="]
LONG = ["".join(f"{a}+{a}={2 * a} #### {2 * a}\n" for a in range(10, 30)) + "12+13="]  # a long shared prefix: prefix-cached
FEEDBACK = "<|im_start|>user\nwrong, try again<|im_end|>\n<|im_start|>assistant\n"


LAST = "test_closing_one_engine_leaves_the_other_generating"  # it closes a class-wide engine


def pytest_collection_modifyitems(items):
    """Hook for the engine folders' conftests: the closing test runs after the engine class's own
    tests too (pytest puts a base class's tests first)."""
    for item in [i for i in items if i.name == LAST]:
        items.remove(item)
        same_class = [k for k, other in enumerate(items) if other.cls is item.cls]
        items.insert(same_class[-1] + 1 if same_class else len(items), item)


def build(engine: str, path: str, **options):
    """A real ``engine`` rollout (by its registered name) on the model at ``path``."""
    from trellis.plugins import load_plugins

    entry = load_plugins().registry.get("rollout", engine)
    return entry.obj(RolloutSpec(path, entry.options(**options), AutoTokenizer.from_pretrained(path)))


def forward_log_probs(model, out, temperature):
    """``(samples, response_len)`` log-probs of ``out``'s responses under a plain forward pass."""
    n = out["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]).logits
    logits = logits[:, -n - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)


def greedy(engine, make_prompts, texts=TEXTS, n_tokens=8):
    return engine.generate(make_prompts(engine.tokenizer, texts), SamplingParams(greedy=True, max_new_tokens=n_tokens))


def perturbed(path, seed):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def stream(pairs):
    """``pairs`` as a generator, read once."""
    yield from pairs


class FreshCopies:
    """An export of ``state`` as fresh copies; ``counts``: how many earlier copies were still alive
    (held by the reader) each time the next was made."""

    def __init__(self, state):
        self.state, self.made, self.counts = state, [], []

    def export(self):
        for name, tensor in self.state.items():
            self.counts.append(sum(ref() is not None for ref in self.made))
            copy = tensor.clone()
            self.made.append(weakref.ref(copy))
            yield name, copy
            del copy


def checkpoint_state(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


class RolloutCases:
    """The shared engine tests. ``ENGINE``: registered rollout name; ``UNTIED_OPTIONS``: options of
    the untied model's engine; ``BAD_OPTIONS``: (options, message) pairs; ``RANGED``: how many
    numeric options declare ranges; ``CHOICES``: how many string options declare their values,
    ``OPEN_ENDED``: the string options that take any value; ``CANCEL_AFTER_S``: how long a
    request runs before it is cancelled."""

    ENGINE: ClassVar[str]
    UNTIED_OPTIONS: ClassVar[dict[str, Any]] = {}
    BAD_OPTIONS: ClassVar[list[tuple[dict[str, Any], str]]] = []
    RANGED: ClassVar[int]
    CHOICES: ClassVar[int]
    OPEN_ENDED: ClassVar[tuple[str, ...]] = ()
    CANCEL_AFTER_S: ClassVar[float] = 0.0

    @pytest.fixture(scope="class")
    def engines(self, tiny_model_path, tiny_untied_model_path):
        built = {"tied": build(self.ENGINE, tiny_model_path), "untied": build(self.ENGINE, tiny_untied_model_path, **self.UNTIED_OPTIONS)}
        yield built
        for eng in built.values():
            eng.close()

    @pytest.fixture(scope="class")
    def engine(self, engines):
        return engines["tied"]

    @pytest.fixture
    def restore(self):
        """Load the checkpoint's weights back into the engines a test changed."""
        changed = []
        yield changed.append
        for eng in changed:
            eng.load_weights(checkpoint_state(eng.model_path).items())

    @pytest.fixture(scope="class")
    def actor(self, tiny_model_path):
        from omegaconf import OmegaConf

        from trellis.config import validate
        from trellis.plugins import load_plugins
        from trellis.runtime.worker import build_worker
        from trellis_algos import ActorConfig

        registry = load_plugins().registry
        options = validate(OmegaConf.create({"optim": {"lr": 1e-2}, "micro_batch_samples": 8}), ActorConfig, registry)
        return build_worker(registry, "fsdp", "actor", tiny_model_path, options, {"update": "policy"})

    def idle(self, engine) -> bool:
        """Whether the engine holds no request (an engine that can tell overrides this)."""
        return True

    # -- layout -----------------------------------------------------------------------------------
    def test_layout_and_grouping_match_the_hf_rollout(self, engine, make_prompts):
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

    def test_mask_ends_at_the_first_stop_token(self, engine, make_prompts):
        prompts = make_prompts(engine.tokenizer, TEXTS)
        stop = int(greedy(engine, make_prompts, n_tokens=12)["responses"][0, 2])  # a token prompt 0 meets, made a stop token
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

    def test_left_padding_does_not_change_greedy_outputs(self, engine, make_prompts):
        alone = greedy(engine, make_prompts, ["7+8="])
        batched = greedy(engine, make_prompts)
        n = int(alone["response_mask"][0].sum())
        assert torch.equal(batched["responses"][1, :n], alone["responses"][0, :n])

    # -- log-probs --------------------------------------------------------------------------------
    @pytest.mark.parametrize("params", [SamplingParams(n=3, temperature=0.7, max_new_tokens=10), SamplingParams(greedy=True, max_new_tokens=10)])
    def test_log_probs_equal_the_fsdp_actor(self, engine, actor, make_prompts, params):
        out = engine.generate(make_prompts(engine.tokenizer, TEXTS), params)
        lp = actor.log_prob(out)["log_probs"] * out["response_mask"]
        torch.testing.assert_close(out["rollout_log_probs"], lp, atol=1e-4, rtol=0)

    # -- weight sync ------------------------------------------------------------------------------
    @pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
    @pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
    def test_outputs_and_log_probs_follow_synced_weights(self, tied, streamed, engines, make_prompts, restore):
        """Whole: a list, read before loading. Streamed: a generator with its manifest (as the
        trainer's sync sends it), read one tensor at a time."""
        eng = engines["tied" if tied else "untied"]
        prompts = make_prompts(eng.tokenizer, TEXTS + LONG)
        assert prompts["input_ids"].shape[1] > 256  # more than two KV blocks of 128: prefix-cached
        params = SamplingParams(n=2, temperature=0.8, max_new_tokens=8)
        eng.generate(prompts, params)  # fills the prefix cache with the old weights' KV
        other = perturbed(eng.model_path, seed=7)
        state = other.state_dict()
        if tied:  # an exporter may give the shared tensor once: the engine must still update its head
            assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
            state.pop("lm_head.weight")
        restore(eng)
        if streamed:
            eng.load_weights(stream(state.items()), shapes={name: t.shape for name, t in state.items()})
        else:
            eng.load_weights(list(state.items()))
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

    def test_rollout_follows_the_actor_after_update_and_sync(self, engine, actor, make_prompts, restore):
        prompts = make_prompts(engine.tokenizer, TEXTS)
        params = SamplingParams(n=4, max_new_tokens=8)
        out = engine.generate(prompts, params)
        out["old_log_probs"] = actor.log_prob(out)["log_probs"]
        out["advantages"] = torch.linspace(-1, 1, len(out))[:, None] * out["response_mask"]
        actor.train("update", out)
        stale = engine.generate(prompts, params)
        assert (actor.log_prob(stale)["log_probs"] * stale["response_mask"] - stale["rollout_log_probs"]).abs().max() > 1e-3
        restore(engine)
        sync_from(engine, actor)  # the controllers' sync: the actor's manifest, then its export streamed
        after = engine.generate(prompts, params)
        torch.testing.assert_close(actor.log_prob(after)["log_probs"] * after["response_mask"], after["rollout_log_probs"], atol=1e-4, rtol=0)

    def test_a_streamed_sync_holds_a_few_tensors_at_a_time(self, engines):
        """The untied engine (SGLang: 10 KiB buckets) loads the checkpoint's tensors, fresh copies
        made as they are read: with the manifest, fewer than one decoder layer's tensors are alive
        (not yet dropped by the engine) whenever the next is made; read whole, all of them."""
        eng = engines["untied"]
        state = checkpoint_state(eng.model_path)
        layer = sum(name.startswith("model.layers.0.") for name in state)
        peaks = {}
        for streamed in (True, False):
            alive = FreshCopies(state)
            eng.load_weights(alive.export(), shapes={name: t.shape for name, t in state.items()} if streamed else None)
            peaks[streamed] = max(alive.counts)
        assert peaks[True] < layer < len(state) - 1 == peaks[False], peaks

    def test_refused_sync_fails_clearly_and_the_engine_still_generates(self, engine, make_prompts):
        before = greedy(engine, make_prompts)
        state = checkpoint_state(engine.model_path)
        name, q = "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"
        refused = [
            ([(name, state[name] + 1), ("model.layers.0.mlp.up_projj.weight", state[name])],
             r"unknown parameter '\S+up_projj.weight'.*closest names: \['model.layers.0.mlp.up_proj.weight'"),
            ([("model.norm.weight", state["model.norm.weight"] + 1), (name, torch.zeros(3, 3))],
             rf"'{name}' has shape \(3, 3\), the engine expects \({state[name].shape[0]}, {state[name].shape[1]}\)"),
            ([("model.norm.weight", state["model.norm.weight"].long())],
             r"'model.norm.weight' has dtype torch.int64; the engine's weights are floating point"),
            ([(q, state[q] + 1)], r"module 'model.layers.1.self_attn.qkv_proj' is updated only in part; missing \["),
            ([(name, state[name]), (name, state[name])], "given twice"),
        ]  # fmt: skip
        for update, message in refused:
            with pytest.raises(WeightSyncError, match=message):
                engine.load_weights(update)
        for update, message in refused[:2] + refused[3:4]:  # the same as manifests: nothing is read
            read = []
            with pytest.raises(WeightSyncError, match=message):
                engine.load_weights((read.append(n) or (n, t) for n, t in update), shapes={n: t.shape for n, t in update})
            assert read == []
        after = greedy(engine, make_prompts)
        assert torch.equal(after["responses"], before["responses"])
        torch.testing.assert_close(after["rollout_log_probs"], before["rollout_log_probs"], atol=1e-6, rtol=0)  # prefix-cached: float noise

    # -- async, sleep, options --------------------------------------------------------------------
    def test_agenerate_runs_concurrent_samples_from_any_event_loop(self, engine, make_prompts):
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
        assert self.idle(engine)

    def test_cancelled_agenerate_is_aborted_and_others_finish(self, engine, make_prompts):
        ids = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]

        async def run():
            slow = asyncio.ensure_future(engine.agenerate(ids[0], SamplingParams(greedy=True, max_new_tokens=400)))
            fast = asyncio.ensure_future(engine.agenerate(ids[1], SamplingParams(greedy=True, max_new_tokens=4)))
            await asyncio.sleep(self.CANCEL_AFTER_S)
            slow.cancel()
            return await fast, slow

        fast, slow = asyncio.run(run())
        assert slow.cancelled() and 1 <= len(fast.token_ids) <= 4
        assert self.idle(engine)
        assert len(greedy(engine, make_prompts)) == 3

    def test_sleep_on_cpu_says_so_once_and_carries_on(self, engine, make_prompts, caplog):
        if not engine.on_cpu:
            pytest.skip("memory release works on GPU")
        with caplog.at_level(logging.WARNING, logger="trellis"):
            for _ in range(2):
                engine.sleep()
                engine.wake(["weights"])
                engine.wake()
        said = [r for r in caplog.records if "sleep/wake is unsupported on CPU" in r.getMessage()]
        assert len(said) <= 1  # once per process (an earlier test may have said it already)
        assert not engine.asleep
        assert len(greedy(engine, make_prompts)) == 3

    def test_bad_options_fail_with_the_option_name(self, tiny_model_path):
        for options, message in self.BAD_OPTIONS:
            with pytest.raises(ValueError, match=message):
                build(self.ENGINE, tiny_model_path, **options)

    def test_plugin_registers_the_rollout_with_ranged_options(self, assert_ranges_enforced):
        from trellis.plugins import load_plugins

        registry = load_plugins().registry
        entry = registry.get("rollout", self.ENGINE)
        assert callable(entry.obj) and entry.options.__name__.lower().startswith(self.ENGINE)
        assert assert_ranges_enforced(entry.options, registry) == self.RANGED

    def test_plugin_declares_the_values_of_its_string_options(self, assert_choices_enforced):
        from trellis.plugins import load_plugins

        registry = load_plugins().registry
        options = registry.get("rollout", self.ENGINE).options
        assert assert_choices_enforced(options, registry, self.OPEN_ENDED) == self.CHOICES

    def files_outside(self, engine) -> list[str]:
        """Files the engine keeps outside its processes while it runs (none by default)."""
        return []

    def test_closing_one_engine_leaves_the_other_generating(self, engines, make_prompts):
        """Last of the class: closes the untied engine, which removes the files it kept outside its
        processes. A closed engine refuses work by name."""
        files = self.files_outside(engines["untied"])
        assert all(os.path.exists(f) for f in files), files
        engines["untied"].close()
        engines["untied"].close()  # twice: harmless
        assert not [f for f in files if os.path.exists(f)]
        with pytest.raises(RuntimeError, match=f"rollout '{self.ENGINE}' is closed"):
            greedy(engines["untied"], make_prompts)
        assert len(greedy(engines["tied"], make_prompts)) == 3


def always_wrong_agent(tokenizer, max_assistant_turns: int, max_user_turns: int, max_response_tokens: int):
    """The rollout function (core's default agent loop) of conversations whose every answer is
    called wrong, within these limits: ``asyncio.run(agent(engine, prompts, params))``."""
    from omegaconf import OmegaConf

    from trellis.config import validate
    from trellis.interfaces.agents import Interaction, InteractionTurn
    from trellis.plugins import load_plugins
    from trellis_algos.rl.multi_turn import MultiTurnConfig
    from trellis_multiturn.environment import agent_spec
    from trellis_multiturn.rollout import agent_rollout

    class Wrong(Interaction):
        async def respond(self, instance_id, messages):
            return InteractionTurn(done=False, message="wrong, try again", score=0.0)

    registry = load_plugins().registry
    registry.adding_for("engine_cases")
    registry.add("interaction", "always_wrong", Wrong)
    section = {"enable": True, "max_assistant_turns": max_assistant_turns, "max_user_turns": max_user_turns,
               "max_response_tokens": max_response_tokens, "interactions": [{"name": "w", "component": "always_wrong"}]}  # fmt: skip
    return agent_rollout(agent_spec(validate(OmegaConf.create(section), MultiTurnConfig, registry, "multi_turn."), registry, tokenizer), registry)


class MultiTurnCases:
    """Conversations through the agent loop on the real engine ``ENGINE``, whose context option is
    ``CONTEXT`` (vLLM ``max_model_len``, SGLang ``context_length``)."""

    ENGINE: ClassVar[str]
    CONTEXT: ClassVar[str]

    def test_conversations_are_token_exact_with_matching_log_probs(self, tiny_model_path):
        """Environment turns are the chat template's tokens, and the rollout log-probs of the
        model's tokens equal a forward pass over the whole conversation."""
        from trellis_algos import PromptDataset
        from trellis_demo.tasks import make_arithmetic_split

        engine = build(self.ENGINE, tiny_model_path, **{self.CONTEXT: 256})
        tokenizer = engine.tokenizer
        agent = always_wrong_agent(tokenizer, max_assistant_turns=3, max_user_turns=2, max_response_tokens=120)
        prompts = PromptDataset(make_arithmetic_split(3, 0, max_value=30), tokenizer, 64).as_batch()
        try:
            out = asyncio.run(agent(engine, prompts, SamplingParams(n=2, max_new_tokens=6)))
        finally:
            engine.close()

        assert out["num_turns"].tolist() == [3] * 6 and list(out["finish_reason"]) == ["max_user_turns"] * 6
        for row in range(6):
            mask = out["response_mask"][row].tolist()
            ids = out["responses"][row].tolist()
            length = int(out["attention_mask"][row].sum() - prompts["attention_mask"][row // 2].sum())
            # runs of environment tokens (mask 0) inside the response: exactly the two feedback turns
            runs, start = [], None
            for i in range(length):
                if mask[i] == 0 and start is None:
                    start = i
                if mask[i] == 1 and start is not None:
                    runs.append((start, i))
                    start = None
            assert len(runs) == 2
            for _, end in runs:
                assert tokenizer.decode(ids[:end]).endswith("<|im_end|>\n" + FEEDBACK)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        torch.testing.assert_close(out["rollout_log_probs"], forward_log_probs(model, out, 1.0) * out["response_mask"], atol=1e-4, rtol=0)


def run_rl_with(engine: str, context_option: str, model_path: str, tmp_path) -> None:
    """The rl recipe end to end with ``rollout.name=<engine>``, the only change from the default
    config (plus a small context): 3 steps, finite metrics, a validation reward in [0, 1]."""
    import json
    import math

    from trellis.recipes.train import train
    from trellis_demo.tasks import make_arithmetic_split, write_rows

    train_file = write_rows(make_arithmetic_split(64, 0, max_value=50), tmp_path / "train.parquet")
    test_file = write_rows(make_arithmetic_split(8, 0, split="test", max_value=50), tmp_path / "test.jsonl")
    run_dir = tmp_path / "rl"
    summary = train(
        None,
        [
            "recipe=rl",
            f"model.path={model_path}",
            f"data.train_path={train_file}",
            f"data.val_path={test_file}",
            "data.train_batch_prompts=4",
            "sampling.n=4",
            "sampling.max_new_tokens=6",
            "actor.micro_batch_samples=8",
            "actor.optim.lr=1e-3",
            f"rollout.name={engine}",
            f"rollout.{context_option}=128",
            "trainer.total_steps=3",
            "trainer.trackers=[jsonl]",
            f"trainer.run_dir={run_dir}",
        ],
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:
        for key in ("timing/gen_s", "timing/weight_sync_s", "actor/pg_loss", "response/length_mean"):
            assert key in row and math.isfinite(row[key]), (key, row)
        assert 0.0 <= row["response/length_mean"] <= 6
    assert 0.0 <= summary["val_after"]["reward_mean"] <= 1.0


# a reward with signal on an untrained model (each sync then carries weights that moved): the response's length
LENGTH_REWARD = """
def length(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 20
"""
# figures that depend on the clock, or on where the engine runs
PLACEMENT_FIGURES = ("timing/", "dispatch/", "sync/")


def length_rewarded_rl(model_path: str, tmp_path, name: str) -> list[str]:
    """The rl recipe's overrides for 3 GRPO steps rewarded by the response's length (sampling seed
    11, one process, the HF rollout unless more overrides name another), writing ``tmp_path/name``."""
    from trellis_demo.tasks import make_arithmetic_split, write_rows

    data = write_rows(make_arithmetic_split(16, 0, max_value=50), tmp_path / "train.parquet")
    reward = tmp_path / "length.py"
    reward.write_text(LENGTH_REWARD)
    return ["recipe=rl", f"model.path={model_path}", f"data.train_path={data}", "data.train_batch_prompts=2", "sampling.n=4",
            "sampling.max_new_tokens=5", "sampling.seed=11", f"reward.path={reward}", "reward.name=length", "actor.optim.lr=1e-2",
            "trainer.total_steps=3", "trainer.trackers=[jsonl]", f"trainer.run_dir={tmp_path / name}"]  # fmt: skip


def step_rows(run_dir) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` that a training step wrote."""
    import json
    from pathlib import Path

    rows = [json.loads(r) for r in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def rl_on_ray(model_path: str, tmp_path, name: str, *overrides: str) -> list[dict]:
    """:func:`length_rewarded_rl` under Ray (one rank), in this process; its step rows. Needs a
    running Ray cluster."""
    from trellis.recipes.train import train

    train(None, [*length_rewarded_rl(model_path, tmp_path, name), "trainer.controller=ray", "trainer.procs_per_node=1", *overrides])
    return step_rows(tmp_path / name)


def assert_same_run(a: list[dict], b: list[dict]) -> None:
    """Two runs of :func:`length_rewarded_rl` sampled the same tokens (every ``reward/`` and
    ``response/`` figure equal) and learned alike: every other figure equal to float32 rounding
    (another process or backend sums in another order; the rollout-correction figures are noise
    of ~1e-6); clock, dispatch and sync figures aside."""
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert all(r["actor/grad_norm"] > 0 for r in b)  # the policy moves: every sync carries new weights
    assert len({r["actor/entropy"] for r in b}) == 3
    for x, y in zip(a, b):
        keys = {k for k in x if not k.startswith(PLACEMENT_FIGURES)}
        assert keys == {k for k in y if not k.startswith(PLACEMENT_FIGURES)}
        sampled = [k for k in keys if k.startswith(("reward/", "response/"))]
        assert {k: x[k] for k in sampled} == {k: y[k] for k in sampled}
        assert {k: y[k] for k in keys} == pytest.approx({k: x[k] for k in keys}, rel=1e-5, abs=1e-5)


def check_engine_process_equals_rank(model_path: str, tmp_path, *engine_keys: str) -> None:
    """The engine ``engine_keys`` name (``rollout.name=...``; none: HF) under Ray, built in the
    actor's rank process beside FSDP, then in an engine process of its own
    (``trainer.rollout_pool=1``, the object store transport): the same run (:func:`assert_same_run`),
    and after every sync the probe's engine-vs-trainer gap stays at float32 noise while the policy
    moves (a lost sync would stop the run)."""
    colocated = rl_on_ray(model_path, tmp_path, "colocated", *engine_keys)
    pooled = rl_on_ray(model_path, tmp_path, "pooled", *engine_keys, "trainer.rollout_pool=1")
    assert_same_run(colocated, pooled)
    assert all(r["sync/probe_gap"] < 1e-5 for r in colocated + pooled)


def check_engine_process_one_step_ahead(model_path: str, tmp_path, *keys: str) -> None:
    """The engine ``keys`` name (and a transport, if they name one) in a process of its own
    generates one step ahead while the actor trains: later steps train on samples at most one
    weight version old, and every sync lands (probe gap)."""
    rows = rl_on_ray(model_path, tmp_path, "one_step", *keys, "trainer.rollout_pool=1", "trainer.async_mode=one_step")
    assert rows[0]["rollout/staleness_max"] == 0.0
    assert all(r["rollout/staleness_max"] <= 1.0 for r in rows) and sum(r["rollout/staleness_mean"] for r in rows) > 0
    assert all(r["sync/probe_gap"] < 1e-3 for r in rows)


def judge_post(url: str, body: dict, token: str | None, route: str = "/v1/chat/completions") -> tuple[int, dict | str]:
    """POST ``body`` to a judge server's ``route`` with ``token`` as bearer; (status, JSON reply, or the text of one that is not JSON)."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url + route, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode()
        return exc.code, json.loads(text) if text.startswith("{") else text


def judge_closed(url: str) -> bool:
    """Whether nothing answers at ``url`` any more."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(url + "/v1/models", timeout=5)
    except urllib.error.HTTPError:
        return False  # it answered
    except (urllib.error.URLError, OSError):
        return True
    return False


def check_judge_engine(engine: str, model_path: str, **options) -> None:
    """``reward.judge`` on ``engine`` (built with ``options``, the keys it takes under ``rollout``):
    the server answers chat completions with the run's token only, greedy replies repeat, another
    model, tools and an out-of-range temperature are refused by name, the counts add up, and
    nothing answers after close (twice is harmless)."""
    from trellis.plugins import load_plugins
    from trellis_algos.rewards import JudgeEngineConfig
    from trellis_judges.engine import start_judge

    spec = JudgeEngineConfig(engine=engine, model=model_path, options=options, max_new_tokens=5)
    server = start_judge(spec, load_plugins().registry, seed=0)
    try:
        ask = {"messages": [{"role": "user", "content": "2+3="}], "max_tokens": 3, "temperature": 0}
        status, reply = judge_post(server.url, ask, server.token)
        assert status == 200 and reply["model"] == model_path
        assert 0 < reply["usage"]["completion_tokens"] <= 3 and isinstance(reply["choices"][0]["message"]["content"], str)
        # greedy: the same prompt gets the same reply
        assert judge_post(server.url, ask, server.token)[1]["choices"][0]["message"] == reply["choices"][0]["message"]
        assert judge_post(server.url, ask, None)[0] == 401 and judge_post(server.url, ask, "wrong")[0] == 401
        status, refused = judge_post(server.url, {**ask, "model": "gpt-4o"}, server.token)
        assert status == 404 and f"this server serves {model_path!r}" in refused["error"]["message"]
        status, refused = judge_post(server.url, {**ask, "tools": [{"type": "function", "function": {"name": "f"}}]}, server.token)
        assert status == 400 and "serves no tools" in refused["error"]["message"]
        status, refused = judge_post(server.url, {**ask, "temperature": 3}, server.token)
        assert status == 400 and "temperature=3" in refused["error"]["message"]
        counts = server.counts()
        assert counts["requests"] == 2 and counts["refused"] == 5 and counts["completion_tokens"] == 2 * reply["usage"]["completion_tokens"]
        check_reward_router(server, ask, reply)
    finally:
        server.close()
        server.close()
    assert judge_closed(server.url)


def check_reward_router(server, ask: dict, reply: dict) -> None:
    """The judge server as verl's reward router (``server.address``, no header): SGLang's native
    ``/generate`` from text or from token ids answers what chat completions answer greedily for the
    same rendered prompt; chat completions answer under the address too; what it cannot honour is
    refused by name, and without the token in the path nothing is found."""
    from trellis import encode_text, render_chat

    router = f"http://{server.address}"
    text = render_chat(server.tokenizer, ask["messages"], True, {})
    greedy = {"max_new_tokens": 3, "temperature": 0}
    content, used = reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]
    for prompt in ({"text": text}, {"input_ids": encode_text(server.tokenizer, text)}):
        status, native = judge_post(router, {**prompt, "sampling_params": greedy}, None, "/generate")
        assert status == 200 and native["text"] == content and len(native["output_ids"]) == used
        assert native["meta_info"]["prompt_tokens"] == reply["usage"]["prompt_tokens"] and native["meta_info"]["completion_tokens"] == used
        assert native["meta_info"]["finish_reason"]["type"] == reply["choices"][0]["finish_reason"]
    status, chat = judge_post(router, ask, None)
    assert status == 200 and chat["choices"][0]["message"]["content"] == content
    status, refused = judge_post(router, {"text": text, "sampling_params": {**greedy, "stop": ["\\n"]}}, None, "/generate")
    assert status == 400 and "sampling_params stop is not served here" in refused["error"]["message"]
    status, refused = judge_post(router, {"text": text, "input_ids": [1], "sampling_params": greedy}, None, "/generate")
    assert status == 400 and "not both and not neither" in refused["error"]["message"]
    assert judge_post(server.url, {"text": text}, None, "/generate")[0] == 404  # the token is the path
    counts = server.counts()
    assert counts["requests"] == 5 and counts["refused"] == 7


class OnRayCases:
    """The rl recipe under a private local Ray cluster (loopback) with the engine ``ENGINE_KEYS``
    name, in the actor's rank process and in a rollout pool of its own. Needs Ray."""

    ENGINE_KEYS: ClassVar[tuple[str, ...]] = ()  # e.g. ("rollout.name=vllm", "rollout.max_model_len=128")

    @pytest.fixture(scope="class")
    def ray_cluster(self):
        """3 logical CPUs (an actor rank, an engine process, a spare); started after the session's
        conftest set the engine's environment, which Ray's workers inherit."""
        import tempfile

        ray = pytest.importorskip("ray")
        ray.init(num_cpus=3, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="trellis-ray-test-"), log_to_driver=False)
        yield
        ray.shutdown()

    def test_an_engine_process_of_its_own_equals_the_engine_in_the_rank(self, ray_cluster, tiny_model_path, tmp_path):
        check_engine_process_equals_rank(tiny_model_path, tmp_path, *self.ENGINE_KEYS)

    def test_an_engine_process_of_its_own_one_step_ahead(self, ray_cluster, tiny_model_path, tmp_path):
        check_engine_process_one_step_ahead(tiny_model_path, tmp_path, *self.ENGINE_KEYS)


def check_megatron_equals_fsdp(model_path: str, tmp_path, *engine_keys: str) -> None:
    """The Megatron backend's weights reach the engine ``engine_keys`` name in Hugging Face names
    (mbridge's export) at every sync: with the same seeds the run samples the same tokens and learns
    the same figures as the FSDP backend's to float32 rounding, and after each sync the probe's
    engine-vs-trainer gap is float32 noise (a lost or misnamed tensor would stop the run). Each run
    is a recipe process with the Megatron CPU shim (``tests/megatron/boot``, test scaffolding:
    Megatron-Core asks for CUDA where these CPU runs reach it)."""
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "megatron"))
    from ranks import boot_env

    train = "import sys; from trellis.recipes.train import train; train(None, sys.argv[1:])"
    runs = {}
    for backend in ("fsdp", "megatron"):
        args = [*length_rewarded_rl(model_path, tmp_path, backend), *engine_keys, f"backend.name={backend}"]
        done = subprocess.run([sys.executable, "-c", train, *args], env=boot_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[backend] = step_rows(tmp_path / backend)
    assert_same_run(runs["fsdp"], runs["megatron"])
    assert all(r["sync/probe_gap"] < 1e-5 for r in runs["fsdp"] + runs["megatron"])
