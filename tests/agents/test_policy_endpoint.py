"""The policy endpoint's tool calls, completions API and re-rendering templates, through the real
``openai`` client over HTTP on loopback; the engine is ``ScriptedEngine`` (a random tiny model
cannot be made to write a given tool call), so every reply and every sampled id is known."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import openai
import pytest
from omegaconf import OmegaConf
from scripted import REASONING_TEMPLATE, ScriptedEngine

import trellis_agents.endpoint as endpoint_module
from trellis.config import ConfigError, validate
from trellis.data import encode_text, render_chat
from trellis.interfaces.rollout import SamplingParams
from trellis.plugins import load_plugins
from trellis_agents.endpoint import HEADER, PolicyEndpoint
from trellis_agents.loop import OpenAIAgentLoop
from trellis_algos import PromptDataset
from trellis_algos.rl.multi_turn import MultiTurnConfig
from trellis_demo.tiny import TOOLS_CHAT_TEMPLATE, make_tiny_tokenizer
from trellis_demo.tool_call import ADD
from trellis_multiturn import ChatDeltas
from trellis_multiturn.environment import agent_spec
from trellis_multiturn.rollout import AgentRollout
from trellis_multiturn.sampled import check_sampled
from trellis_multiturn.tool_calls import HermesParser

AGENTS = Path(__file__).parents[1] / "openai_agents.py"

PROMPT = [{"role": "user", "content": "12+34="}]
TEXTS = ['<think>45 or 47?</think>#### 45 wrong, try again 12+34= Let me add.<tool_call>{"name": "add", "arguments": {"a": 12, "b": 34}}</tool_call>']


def tokenizer_with(template):
    tokenizer = make_tiny_tokenizer(TEXTS * 20)
    tokenizer.chat_template = template
    return tokenizer


def episode_run(tokenizer, script, agent, kwargs=None, max_turns=3):
    """Serve one episode of ``agent(client, sample_text, sample_ids)`` on a fresh endpoint; returns
    (the episode, the engine, what the agent returned)."""
    kwargs = kwargs or {}
    engine = ScriptedEngine(tokenizer, script)
    prompt_text = render_chat(tokenizer, PROMPT, True, kwargs)

    async def run():
        endpoint = PolicyEndpoint(engine, tokenizer, kwargs, HermesParser())
        await endpoint.start()
        episode = endpoint.open(encode_text(tokenizer, prompt_text), PROMPT, SamplingParams(max_new_tokens=64), 512, max_turns, [])
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key=endpoint.token, default_headers={HEADER: episode.id}, max_retries=0)
        try:
            return episode, await agent(client, prompt_text, episode.chain_ids)
        finally:
            await endpoint.end(episode)
            await client.close()
            await endpoint.close()

    episode, out = asyncio.run(run())
    return episode, engine, out


def assert_trains_on_the_sampled_ids(episode, tokenizer):
    traj = episode.trajectory
    sampled = [c.generation for c in episode.calls]
    assert all(c.trained for c in episode.calls) and not episode.ended
    assert [i for i, m in zip(traj.response_ids, traj.response_mask) if m] == [i for g in sampled for i in g.token_ids]
    check_sampled(traj, sampled, "openai_agent", tokenizer)
    for call in episode.calls:  # each call sampled after the trajectory so far, token for token
        assert call.prompt_ids == episode.chain_ids[: len(call.prompt_ids)]


async def call_then_answer(client, prompt_text, prompt_ids):
    """The openai client's tool-calling API as an agent uses it: the reply's message goes back as
    is, the result as a ``tool`` message with its ``tool_call_id``."""
    messages = list(PROMPT)
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
    message = first.choices[0].message
    call = message.tool_calls[0]
    result = sum(json.loads(call.function.arguments).values())
    messages += [message, {"role": "tool", "tool_call_id": call.id, "content": str(result)}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
    return first, second


@pytest.mark.parametrize(
    ("written", "rerendered"),
    [('{"name": "add", "arguments": {"a": 12, "b": 34}}', False), ('{"name":"add","arguments":{"a":12,"b":34}}', True)],
    ids=["as the template writes it", "compact"],
)
def test_a_tool_call_reaches_the_openai_client_and_its_result_continues_the_trajectory(written, rerendered, caplog, monkeypatch):
    """The model's ``<tool_call>`` comes back as ``message.tool_calls``; the follow-up (the
    assistant message with its tool_calls, the tool result) extends the sampled ids. A call written
    as the template renders it continues by text; a compact one the template re-renders with
    spaces, so the endpoint keeps the sampled ids and says so once."""
    monkeypatch.setattr(endpoint_module, "_SAID", set())
    tokenizer = tokenizer_with(TOOLS_CHAT_TEMPLATE)
    script = [f"Let me add.<tool_call>{written}</tool_call>", "#### 46"]
    with caplog.at_level(logging.WARNING, logger="trellis"):
        episode, engine, (first, second) = episode_run(tokenizer, script, call_then_answer, {"tools": [ADD]})

    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and json.loads(call.function.arguments) == {"a": 12, "b": 34}
    assert call.id.startswith("call_")
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == "#### 46"
    assert second.choices[0].message.tool_calls is None

    assert_trains_on_the_sampled_ids(episode, tokenizer)
    first_call, second_call = episode.calls
    between = second_call.prompt_ids[len(first_call.prompt_ids) + len(first_call.generation.token_ids) :]
    assert tokenizer.decode(between) == "\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n"  # the tool message, as the template renders it
    assert tokenizer.decode(first_call.generation.token_ids) == script[0] + "<|im_end|>"  # the call is trained as sampled
    said = [r.getMessage() for r in caplog.records if "renders the conversation so far differently" in r.getMessage()]
    assert len(said) == rerendered  # as written, the call renders as the model wrote it: continued by text
    assert all(episode.id in line and "the sampled ids are kept" in line for line in said)


def test_a_template_that_drops_earlier_reasoning_keeps_the_sampled_ids_and_says_so_once(caplog, monkeypatch):
    """Each follow-up re-renders the first turn without its <think>: the endpoint appends the
    feedback after the sampled ids (the reasoning stays, as sampled) and logs once which
    trajectory, where the rendering first differs, and that the sampled ids are kept. Training on
    the re-rendered history instead would train on ids the model never sampled."""
    monkeypatch.setattr(endpoint_module, "_SAID", set())
    tokenizer = tokenizer_with(REASONING_TEMPLATE)
    script = ["<think>45 or 47?</think>#### 45", "<think>so 46</think>#### 46", "#### 46"]
    feedback = {"role": "user", "content": "wrong, try again"}

    async def agent(client, prompt_text, prompt_ids):
        messages = list(PROMPT)
        for _ in range(3):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}, feedback]
        return messages[:-1]

    with caplog.at_level(logging.WARNING, logger="trellis"):
        episode, engine, messages = episode_run(tokenizer, script, agent)

    assert_trains_on_the_sampled_ids(episode, tokenizer)
    prompt_ids = engine.prompts[0]
    first = episode.calls[0].generation.token_ids
    assert tokenizer.decode(first).startswith("<think>45 or 47?</think>")
    delta = ChatDeltas(tokenizer).after_model(first, [feedback])
    assert episode.calls[1].prompt_ids == prompt_ids + first + delta  # the reasoning the model sampled is kept
    rerendered = encode_text(tokenizer, render_chat(tokenizer, messages[:3] + [feedback], True, {}))
    assert rerendered[: len(prompt_ids)] == prompt_ids and rerendered[len(prompt_ids) :] != first + delta  # what re-tokenising would train on
    assert tokenizer.decode(rerendered[len(prompt_ids) :]).startswith("#### 45<|im_end|>")

    said = [r.getMessage() for r in caplog.records if "renders the conversation so far differently" in r.getMessage()]
    assert len(said) == 1  # two re-rendered follow-ups, one line
    assert f"trajectory {episode.id}" in said[0] and f"first at token {len(prompt_ids)} (response position 0" in said[0]
    assert "sampled '<think>45 or 47', rendered '#### 45" in said[0] and "the sampled ids are kept" in said[0]


def test_completions_take_text_or_ids_and_continue_the_trajectory():
    """``/v1/completions``: the first call's prompt is the sample's ids, the next one text that
    extends the first prompt and the sampled text (the trajectory id in ``user``); both are trained
    as sampled, with the sampled tokens' log-probs in the reply."""
    tokenizer = tokenizer_with(TOOLS_CHAT_TEMPLATE)
    feedback = "<|im_end|>\n<|im_start|>user\nwrong, try again<|im_end|>\n<|im_start|>assistant\n"

    async def agent(client, prompt_text, prompt_ids):
        trajectory = client.default_headers[HEADER]
        anonymous = client.with_options(default_headers={HEADER: openai.Omit()})
        first = await anonymous.completions.create(model="policy", prompt=list(prompt_ids), max_tokens=20, logprobs=0, user=trajectory)
        second = await client.completions.create(model="policy", prompt=prompt_text + first.choices[0].text + feedback)
        return first, second

    episode, engine, (first, second) = episode_run(tokenizer, ["#### 45", "#### 46"], agent)
    assert first.object == "text_completion" and first.choices[0].text == "#### 45" and second.choices[0].text == "#### 46"
    assert first.choices[0].finish_reason == "stop" and first.usage.completion_tokens == len(episode.calls[0].generation.token_ids)
    logprobs = first.choices[0].logprobs
    assert logprobs.token_logprobs == [-0.25] * len(episode.calls[0].generation.token_ids) and logprobs.tokens[-1] == "<|im_end|>"
    assert second.choices[0].logprobs is None  # not asked
    assert_trains_on_the_sampled_ids(episode, tokenizer)
    first_call, second_call = episode.calls
    between = second_call.prompt_ids[len(first_call.prompt_ids) + len(first_call.generation.token_ids) :]
    assert tokenizer.decode(between) == feedback[len("<|im_end|>") :]  # the model sampled its own <|im_end|>


def test_the_endpoint_refuses_what_it_cannot_serve_naming_the_field():
    tokenizer = tokenizer_with(TOOLS_CHAT_TEMPLATE)
    refused = {}

    async def agent(client, prompt_text, prompt_ids):
        async def ask(name, create, **kwargs):
            try:
                await create(model="policy", **kwargs)
            except openai.BadRequestError as exc:
                refused[name] = exc.message

        chat, text = client.chat.completions.create, client.completions.create
        await ask("echo", text, prompt=prompt_text, echo=True)
        await ask("logprobs", text, prompt=prompt_text, logprobs=2)
        await ask("two prompts", text, prompt=[prompt_text, prompt_text])
        await ask("bad id", text, prompt=[*prompt_ids, 10**6])
        await ask("suffix", text, prompt=prompt_text, suffix="!")
        await ask("first prompt", text, prompt="12+34=")
        await ask("other tools", chat, messages=PROMPT, tools=[{**ADD, "function": {**ADD["function"], "name": "plus"}}])
        broken = {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{a: 1"}}
        bad_call = {"role": "assistant", "content": None, "tool_calls": [broken]}
        await ask("arguments", chat, messages=[*PROMPT, bad_call], tools=[ADD])
        return None

    episode, engine, _ = episode_run(tokenizer, ["#### 45"], agent, {"tools": [ADD]})
    assert not engine.prompts  # nothing refused was sampled
    assert "echo=true is not supported" in refused["echo"]
    assert "logprobs=2 is not supported" in refused["logprobs"] and "logprobs=0" in refused["logprobs"]
    assert "prompt holds 2 prompts; send one prompt per request" in refused["two prompts"]
    assert f"prompt[{len(episode.chain_ids)}]=1000000 is not a token id of this model" in refused["bad id"]
    assert "does not support 'suffix'" in refused["suffix"]
    assert "the first call's prompt must begin with the sample's prompt (sample.prompt_text" in refused["first prompt"]
    assert "tools differ from the 1 tool schemas the sample's prompt was rendered with" in refused["other tools"]
    assert "messages[1].tool_calls[0].function.arguments is not JSON" in refused["arguments"]


def test_a_tool_the_agent_runs_itself_is_declared_by_its_schema_alone(monkeypatch):
    """``multi_turn.tools: [{schema: ...}]`` and no component: the prompt is rendered with the
    schema, the agent's request offering the same schema (its own copy) continues that prompt, the
    agent runs the call itself, and the sample trains on exactly the sampled ids."""
    registry = load_plugins().registry
    tokenizer = tokenizer_with(TOOLS_CHAT_TEMPLATE)
    section = {
        "enable": True,
        "agent_loop": "openai_agent",
        "agent": f"{AGENTS}:runs_its_own_add",
        "max_response_tokens": 256,
        "tools": [{"schema": ADD}],
    }
    spec = agent_spec(validate(OmegaConf.create(section), MultiTurnConfig, registry, "multi_turn."), registry, tokenizer)
    assert spec.tools == [] and spec.agent_tools == {"add": "multi_turn.tools[0]"}  # nothing for trellis to run
    batch = PromptDataset([{"prompt": PROMPT}], tokenizer, 512, chat_template_kwargs=spec.template_kwargs).as_batch()
    prompt_ids = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    assert '"name": "add"' in tokenizer.decode(prompt_ids)  # the schema is in the prompt the sample trains on
    episodes, end = [], PolicyEndpoint.end

    async def keep_episode(self, episode):
        await end(self, episode)
        episodes.append(episode)

    monkeypatch.setattr(PolicyEndpoint, "end", keep_episode)
    engine = ScriptedEngine(tokenizer, ['<tool_call>{"name": "add", "arguments": {"a": 12, "b": 34}}</tool_call>', "#### 46"])
    out = asyncio.run(AgentRollout(spec, {"openai_agent": OpenAIAgentLoop})(engine, batch, SamplingParams(max_new_tokens=64)))

    assert out["finish_reason"] == ["done"] and out["agent_rewards"].tolist() == [1.0] and out["num_turns"].tolist() == [2]
    (episode,) = episodes
    assert engine.prompts[0] == prompt_ids  # the agent's first request rendered to the trajectory's prompt, token for token
    assert_trains_on_the_sampled_ids(episode, tokenizer)
    mask = out["response_mask"][0].bool()
    assert out["responses"][0][mask].tolist() == [i for c in episode.calls for i in c.generation.token_ids]
    first, second = episode.calls
    between = second.prompt_ids[len(first.prompt_ids) + len(first.generation.token_ids) :]
    assert tokenizer.decode(between) == "\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n"  # the agent's own result


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"schema": {"type": "function", "function": {"description": "Add."}}}, r"'multi_turn.tools\[0\].schema.function.name' is None"),
        (
            {"schema": {"type": "function", "function": {"name": "add", "description": "Add."}}},
            r"'multi_turn.tools\[0\].schema.function.parameters' is missing from tool 'add', which your agent runs itself",
        ),
        ({"schema": ADD, "max_concurrency": 2}, r"'multi_turn.tools\[0\].max_concurrency' is set for tool 'add', which has only a schema"),
        ({}, r"'multi_turn.tools\[0\]' gives neither 'component' .* or only 'schema'"),
    ],
    ids=["no name", "no parameters", "max_concurrency", "nothing"],
)
def test_a_schema_only_tool_is_refused_by_name_when_incomplete(entry, message):
    registry = load_plugins().registry
    section = {"enable": True, "agent_loop": "openai_agent", "agent": f"{AGENTS}:runs_its_own_add", "tools": [entry]}
    with pytest.raises(ConfigError, match=message):
        agent_spec(validate(OmegaConf.create(section), MultiTurnConfig, registry, "multi_turn."), registry, None)
