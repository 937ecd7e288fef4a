"""Train any agent: a test agent written against the real ``openai`` client talks to the policy
endpoint (a real aiohttp server on loopback in front of the HF engine); the rl recipe trains on
exactly the tokens the endpoint sampled, with the engine's log-probs, and the endpoint refuses what
it cannot serve."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import openai
import pytest
import torch
from multiturn_runs import multi_turn_run
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

import trellis_algos.rl.samples as rl
from trellis.config import ConfigError, validate
from trellis.data import encode_text, render_chat
from trellis.interfaces.rollout import RolloutSpec, SamplingParams
from trellis.plugins import load_plugins
from trellis.recipes.train import train
from trellis_agents.endpoint import HEADER, PolicyEndpoint
from trellis_agents.loop import OpenAIAgentLoop
from trellis_algos import PromptDataset
from trellis_algos.rl.multi_turn import MultiTurnConfig
from trellis_demo.tasks import make_arithmetic_split, write_rows
from trellis_demo.tool_call import ADD, make_tool_calling_model
from trellis_multiturn.environment import agent_spec
from trellis_multiturn.rollout import AgentRollout
from trellis_multiturn.tool_calls import HermesParser

AGENTS = Path(__file__).parents[1] / "openai_agents.py"
AGENT = f"{AGENTS}:answer_then_follow_up"
PROMPT = [{"role": "user", "content": "1+2="}]
FOLLOW_UP_TEXT = "again?"  # openai_agents.FOLLOW_UP
SCHEMA_ONLY = "{type: function, function: {name: add, description: Add., parameters: {type: object}}}"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    return str(write_rows(make_arithmetic_split(16, 0, max_value=30), folder / "train.parquet"))


def overrides(model, data, run_dir, *more):
    loop = ("multi_turn.agent_loop=openai_agent", f"multi_turn.agent={AGENT}", "multi_turn.max_response_tokens=64")
    return multi_turn_run(model, data, run_dir, *loop, *more)


def recorded(monkeypatch) -> tuple[list, list]:
    """The lists every episode the endpoint ends and every batch the rl recipe samples go to."""
    episodes, batches = [], []
    end, sample = PolicyEndpoint.end, rl.sample

    async def keep_episode(self, episode):
        await end(self, episode)
        episodes.append(episode)

    def keep_batch(*args, **kwargs):
        batches.append(sample(*args, **kwargs))
        return batches[-1]

    monkeypatch.setattr(PolicyEndpoint, "end", keep_episode)
    monkeypatch.setattr(rl, "sample", keep_batch)
    return episodes, batches


def test_rl_trains_on_exactly_what_the_endpoint_sampled(tiny_model_path, data, tmp_path, monkeypatch):
    """Two rl steps; every sample is one agent episode of two calls. Its trained tokens are the
    two sampled turns, its environment tokens the follow-up between them, its reward what the
    agent returned, and its rollout log-probs a forward pass of the untrained model (step 1)."""
    episodes, batches = recorded(monkeypatch)
    train(None, overrides(tiny_model_path, data, tmp_path / "run"))

    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in r]
    assert len(steps) == 2 and len(batches) == 2 and len(episodes) == 2 * 4 * 2
    for r in steps:
        assert r["multiturn/finish_done"] == 1.0 and r["multiturn/num_turns_mean"] == 2.0 and r["multiturn/env_errors"] == 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for step, batch in enumerate(batches):
        mine = episodes[step * 8 : (step + 1) * 8]
        by_sequence = {tuple(e.chain_ids): e for e in mine}
        for i in range(len(batch)):
            full = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
            episode = by_sequence.pop(tuple(full))  # the trained sequence is the one the engine saw, token for token
            first, second = episode.calls
            assert first.trained and second.trained
            assert second.prompt_ids[: len(first.prompt_ids) + len(first.generation.token_ids)] == first.prompt_ids + first.generation.token_ids
            mask = batch["response_mask"][i].bool()
            sampled = first.generation.token_ids + second.generation.token_ids
            assert batch["responses"][i][mask].tolist() == sampled
            assert batch["rollout_log_probs"][i][mask].tolist() == pytest.approx(first.generation.log_probs + second.generation.log_probs, abs=0)
            between = second.prompt_ids[len(first.prompt_ids) + len(first.generation.token_ids) :]
            assert FOLLOW_UP_TEXT in tokenizer.decode(between) and tokenizer.decode(between).endswith("<|im_start|>assistant\n")
            reply = tokenizer.decode(second.generation.token_ids, skip_special_tokens=True)
            assert batch["agent_rewards"][i].item() == pytest.approx(len(reply) / 10)
        assert not by_sequence
    assert steps[0]["reward/mean"] == pytest.approx(batches[0]["agent_rewards"].mean().item(), abs=1e-6)

    # step 1 sampled from the initial weights: a plain forward pass gives the rollout's log-probs
    first_step = batches[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=first_step["input_ids"], attention_mask=first_step["attention_mask"], position_ids=first_step["position_ids"]).logits
    width = first_step["responses"].shape[1]
    log_probs = torch.log_softmax(logits[:, -width - 1 : -1].float(), -1).gather(-1, first_step["responses"][..., None])[..., 0]
    mask = first_step["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask], first_step["rollout_log_probs"][mask], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def tool_calling_model(tmp_path_factory):
    return make_tool_calling_model(tmp_path_factory.mktemp("tool-calling"), make_arithmetic_split(16, 0, max_value=30))


def test_rl_trains_on_an_agent_whose_model_calls_a_tool(tool_calling_model, data, tmp_path, monkeypatch):
    """A model that writes tool calls (taught one by SFT: ``trellis_demo.tool_call``) behind the
    endpoint, and an agent on the ``openai`` client that offers its own ``add`` (declared to the
    run by its schema alone), runs the calls the replies carry in ``tool_calls`` and asks again.
    Two rl steps train on exactly the ids the endpoint sampled, with the engine's log-probs."""
    episodes, batches = recorded(monkeypatch)
    tools = f'multi_turn.tools=[{{"schema": {json.dumps(ADD)}}}]'
    loop = ("multi_turn.agent_loop=openai_agent", f"multi_turn.agent={AGENTS}:runs_its_own_add", tools)
    more = ("multi_turn.max_response_tokens=256", "sampling.max_new_tokens=48", "sampling.temperature=0.5", "actor.optim.lr=1e-4")
    train(None, multi_turn_run(tool_calling_model, data, tmp_path / "run", *loop, *more))

    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in r]
    assert len(steps) == 2 and len(episodes) == 2 * 4 * 2
    tokenizer = AutoTokenizer.from_pretrained(tool_calling_model)
    calls = [tokenizer.decode(e.calls[0].generation.token_ids) for e in episodes]
    assert sum('<tool_call>{"name": "add"' in c for c in calls) >= len(calls) // 2  # the model calls the tool
    results = [tokenizer.decode(e.calls[1].prompt_ids) for e in episodes if len(e.calls) == 2]
    assert any("<|im_start|>tool\n46<|im_end|>" in r for r in results)  # the agent ran it and sent the result back
    for batch in batches:
        by_sequence = {tuple(e.chain_ids): e for e in episodes}
        for i in range(len(batch)):
            full = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
            episode = by_sequence[tuple(full)]  # the trained sequence is the one the engine saw, token for token
            mask = batch["response_mask"][i].bool()
            sampled = [t for c in episode.calls if c.trained for t in c.generation.token_ids]
            assert batch["responses"][i][mask].tolist() == sampled
    # step 1 sampled from the initial weights: a plain forward pass gives the rollout's log-probs
    first_step = batches[0]
    model = AutoModelForCausalLM.from_pretrained(tool_calling_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=first_step["input_ids"], attention_mask=first_step["attention_mask"], position_ids=first_step["position_ids"]).logits
    width = first_step["responses"].shape[1]
    log_probs = torch.log_softmax(logits[:, -width - 1 : -1].float() / 0.5, -1).gather(-1, first_step["responses"][..., None])[..., 0]
    mask = first_step["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask], first_step["rollout_log_probs"][mask], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from trellis_hf.engine import make_engine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    return make_engine(RolloutSpec(tiny_model_path, None, tokenizer))


def test_the_endpoint_refuses_what_it_cannot_serve(engine):
    tokenizer = engine.tokenizer
    prompt_ids = encode_text(tokenizer, render_chat(tokenizer, PROMPT, True, {}))
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)

    async def run():
        endpoint = PolicyEndpoint(engine, tokenizer, {}, HermesParser())
        await endpoint.start()
        episode = endpoint.open(prompt_ids, PROMPT, params, budget=256, max_turns=3, turns=[])
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key=endpoint.token, default_headers={HEADER: episode.id}, max_retries=0)
        refused = {}

        async def ask(name, client=client, **kwargs):
            try:
                await client.chat.completions.create(**{"model": "any", "messages": PROMPT, **kwargs})
            except openai.APIStatusError as exc:
                refused[name] = (exc.status_code, exc.message)

        try:
            await ask("no token", client.with_options(api_key="wrong"))
            await ask("unknown trajectory", client.with_options(default_headers={HEADER: "nobody"}))
            await ask("other prompt", messages=[{"role": "system", "content": "be brief"}, *PROMPT])
            await ask("n", n=2)
            await ask("temperature", temperature=0.5)
            await ask("tools", tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])
            await ask("unsupported", logprobs=True)
            assert not episode.calls  # nothing refused was sampled
            reply = await client.chat.completions.create(model="any", messages=PROMPT, temperature=1.0, user=episode.id)
            content = reply.choices[0].message.content
            # an agent that rewrites its history: served, not trained, the trajectory ends before it
            rewritten = [*PROMPT, {"role": "assistant", "content": "!" + content}, {"role": "user", "content": "?"}]
            await client.chat.completions.create(model="any", messages=rewritten)
        finally:
            await endpoint.end(episode)
            await ask("ended trajectory")
            await client.close()
            await endpoint.close()
        return refused, episode, reply

    refused, episode, reply = asyncio.run(run())
    assert refused["no token"][0] == 401 and "bearer token" in refused["no token"][1]
    assert refused["unknown trajectory"][0] == 400 and "unknown trajectory id 'nobody'" in refused["unknown trajectory"][1]
    assert "the first call's messages must begin with the sample's prompt" in refused["other prompt"][1]
    assert "n=2 is not supported" in refused["n"][1]
    assert "temperature=0.5 differs from the run's temperature=1" in refused["temperature"][1]
    assert "chat template does not render tools" in refused["tools"][1]
    assert "does not support 'logprobs'" in refused["unsupported"][1]
    assert "unknown trajectory id" in refused["ended trajectory"][1]  # an ended sample takes no more calls
    assert all(status == 400 for name, (status, _) in refused.items() if name != "no token")
    first, second = episode.calls
    assert first.trained and not second.trained and episode.ended == "history_rewritten"
    assert first.prompt_ids == prompt_ids and episode.trajectory.response_ids == first.generation.token_ids
    assert reply.usage.prompt_tokens == len(prompt_ids) and reply.usage.completion_tokens == len(first.generation.token_ids)
    assert reply.choices[0].message.content == tokenizer.decode(first.generation.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (["multi_turn.agent=''"], r"multi_turn.enable=true needs .* in multi_turn.agent \(with multi_turn.agent_loop=openai_agent\), or"),
        (["multi_turn.agent_loop=tool_agent"], r"config key 'multi_turn.agent' is .*, but neither multi_turn.agent_loop nor any row's"),
        ([f"multi_turn.agent={AGENTS}:not_async"], r"'multi_turn.agent': .*:not_async' is not an async function; define it as `async def"),
        ([f"multi_turn.agent={AGENTS}:answer"], r"multi_turn.agent 'answer' is not defined there in .*; functions found: answer_then_follow_up"),
        (["multi_turn.agent=/nowhere/agent.py:run"], r"multi_turn.agent '/nowhere/agent.py' does not exist"),
        (["multi_turn.score=reward"], r"config key 'multi_turn.score' is reward with multi_turn.agent"),
        (
            ["multi_turn.agent_loop=tool_agent", "multi_turn.agent=''", f"multi_turn.tools=[{{schema: {SCHEMA_ONLY}}}]"],
            r"config key 'multi_turn.tools\[0\]' gives only a schema for tool 'add', which trellis never runs .* but agent loop "
            r"'tool_agent' runs the model's tool calls itself and has no 'add' to run; give the entry a component or verl_class",
        ),
    ],
    ids=["unset", "unused", "not async", "misspelt", "no file", "score reward", "schema-only tool with tool_agent"],
)
def test_agent_config_errors_are_found_before_any_model_is_built(tiny_model_path, data, tmp_path, more, message):
    with pytest.raises(ConfigError, match=message):
        train(None, overrides(tiny_model_path, data, tmp_path / "bad", *more), dry_run=True)
    assert not (tmp_path / "bad").exists()


def test_without_trellis_agents_the_loop_names_its_package_before_any_model_is_built(tiny_model_path, data, tmp_path, monkeypatch):
    plugins = load_plugins()
    plugins.registry.remove_plugin("agents")  # as where trellis-agents is not installed
    monkeypatch.setattr("trellis.registry._distribution_installed", lambda name: False)
    with pytest.raises(ConfigError, match=r"agent_loop 'openai_agent' is not installed: pip install trellis-agents"):
        train(None, overrides(tiny_model_path, data, tmp_path / "bad"), plugins=plugins, dry_run=True)
    assert not (tmp_path / "bad").exists()


def test_an_agent_failing_on_most_samples_stops_the_run_naming_max_error_rate(tiny_model_path, data, tmp_path):
    """An agent that returns no reward fails on every sample: the run stops at its first step with
    one error naming the share and reward.max_error_rate, instead of finishing 100% failed; with
    the rate raised to 1 the same run trains on the turns the agent sampled."""
    from trellis.rewards import RewardError

    agent = f"multi_turn.agent={AGENTS}:returns_none"
    stop = r"^8 of 8 conversations \(100%\) ended in an error of the agent or the environment, above reward.max_error_rate=0.1; "
    with pytest.raises(RewardError, match=stop):
        train(None, [*overrides(tiny_model_path, data, tmp_path / "stops"), agent])
    assert not (tmp_path / "stops" / "metrics.jsonl").exists() or "actor/pg_loss" not in (tmp_path / "stops" / "metrics.jsonl").read_text()
    train(None, [*overrides(tiny_model_path, data, tmp_path / "goes_on"), agent, "reward.max_error_rate=1"])
    steps = [r for r in map(json.loads, (tmp_path / "goes_on" / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in r]
    assert len(steps) == 2 and all(r["multiturn/finish_error"] == 1.0 and r["multiturn/env_errors"] == 8 for r in steps)


def test_an_agent_failing_before_the_model_writes_a_token_skips_the_step_by_name(tiny_model_path, data, tmp_path, caplog):
    """Every conversation ends before its first model turn (the agent raises first): above
    reward.max_error_rate the run stops as above; with the rate raised to 1 each step is logged and
    trains nothing, with one warning saying why (it was a crash inside the loss)."""
    agent = f"multi_turn.agent={AGENTS}:raises_before_asking"
    with caplog.at_level(logging.WARNING, logger="trellis"):
        train(None, [*overrides(tiny_model_path, data, tmp_path / "run"), agent, "reward.max_error_rate=1"])
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "step" in r and r["step"] > 0]
    assert len(steps) == 2 and all(r["actor/skipped_no_model_tokens"] == 1.0 and "actor/pg_loss" not in r for r in steps)
    assert sum("none of the 8 samples holds a token the model wrote" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize(
    ("function", "finish", "reward", "turns"),
    [
        ("raises", "error", 0.0, 1),
        ("sleeps", "timeout", 0.0, 1),
        ("three_turns", "max_assistant_turns", 0.5, 2),
        ("closes_its_client", "done", 1.0, 1),
    ],
)
def test_an_agent_that_fails_or_hits_a_limit_keeps_its_sampled_turns(engine, function, finish, reward, turns):
    """Through the rollout function itself: the turns sampled before the failure or the refused
    call are the sample's (checked as sampled), its reward is 0 or what the agent returned; an
    agent that closes its client does not close the other samples'."""
    registry = load_plugins().registry
    section = {"enable": True, "agent_loop": "openai_agent", "agent": f"{AGENTS}:{function}", "agent_timeout_s": 2, "max_response_tokens": 256}
    spec = agent_spec(validate(OmegaConf.create(section), MultiTurnConfig, registry, "multi_turn."), registry, engine.tokenizer)
    rows = [{"prompt": PROMPT, "data_source": "arithmetic", "reward_model": {"ground_truth": "3"}}]
    batch = PromptDataset(rows, engine.tokenizer, 64).as_batch()
    out = asyncio.run(AgentRollout(spec, {"openai_agent": OpenAIAgentLoop})(engine, batch, SamplingParams(n=2, max_new_tokens=4, seed=0)))
    assert list(out["finish_reason"]) == [finish, finish] and out["num_turns"].tolist() == [turns, turns]
    assert out["agent_rewards"].tolist() == [reward, reward] and out["env_errors"].tolist() == [finish == "error"] * 2
    assert (out["response_mask"].sum(-1) > 0).all()
