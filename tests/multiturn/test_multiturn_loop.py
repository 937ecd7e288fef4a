"""The agent loop on a scripted engine: masks, token-exact turns, interactions per sample, tools,
limits, clean-up on every path, and verl-style classes through the adapters.

A random tiny model cannot be made to write a given answer or tool call, so these tests use
``ScriptedEngine``, a stand-in rollout engine that answers each turn with a scripted text (the
real engines run the same loop in tests/hf, tests/vllm and tests/interactions)."""

from __future__ import annotations

import asyncio

import agent_loops
import pytest
import torch
from scripted import REASONING_TEMPLATE, ScriptedEngine, prompts, row, run, spec, tool_agent

from trellis.config import ConfigError
from trellis.data import encode_text, render_chat
from trellis.interfaces.agents import Interaction, InteractionTurn, Tool, ToolResult, Trajectory
from trellis.interfaces.rollout import Generation, SamplingParams
from trellis.plugins import load_plugins
from trellis_demo.tiny import TOOLS_CHAT_TEMPLATE, make_tiny_tokenizer
from trellis_multiturn import ChatDeltas
from trellis_multiturn.environment import check_interaction_names
from trellis_multiturn.rollout import agent_rollout
from trellis_multiturn.sampled import NotSampled, check_sampled
from trellis_multiturn.scoring import environment_scores

EVENTS: list[tuple[str, str]] = []  # (what, instance) from the recording components below


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["12+34= #### 46 wrong, try again right Error: tool failed timed out truncated characters", '<tool_call>{"name": "add"}']
    tokenizer = make_tiny_tokenizer(texts * 20)
    tokenizer.chat_template = TOOLS_CHAT_TEMPLATE  # the tools these tests configure reach the prompts
    return tokenizer


@pytest.fixture(autouse=True)
def _clear_events():
    EVENTS.clear()


class Checker(Interaction):
    """Right when the last answer contains the sample's ``answer``; records every call."""

    async def start(self, instance_id, answer="46", **kwargs):
        EVENTS.append(("start", instance_id))
        self.answer = answer

    async def respond(self, instance_id, messages):
        EVENTS.append(("respond", instance_id))
        right = self.answer in messages[-1]["content"]
        return InteractionTurn(done=right, message="" if right else "wrong, try again", score=1.0 if right else 0.0)

    async def finalize(self, instance_id):
        EVENTS.append(("finalize", instance_id))


class Raising(Checker):
    async def respond(self, instance_id, messages):
        raise RuntimeError("the checker broke")


class Slow(Checker):
    async def respond(self, instance_id, messages):
        await asyncio.sleep(5)


class Constant(Interaction):
    """Never done; scores every turn ``options`` (a float)."""

    async def respond(self, instance_id, messages):
        return InteractionTurn(done=False, message="again", score=float(self.options))


class Adder(Tool):
    schema = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}

    async def create(self, instance_id, **kwargs):
        EVENTS.append(("create", instance_id))

    async def execute(self, instance_id, arguments):
        return ToolResult(text=str(arguments["a"] + arguments["b"]), reward=0.5)

    async def release(self, instance_id):
        EVENTS.append(("release", instance_id))


class Big(Adder):
    schema = {"type": "function", "function": {"name": "big", "parameters": {"type": "object"}}}

    async def execute(self, instance_id, arguments):
        return ToolResult(text="x" * 1_000_000)


class Broken(Adder):
    schema = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object"}}}

    async def execute(self, instance_id, arguments):
        raise ValueError("no such file")


@pytest.fixture(scope="module")
def registry():
    import trellis_example.plugin
    import trellis_multiturn.plugin

    # core, trellis-multiturn, the example plugin and the loop observation_first, whatever else this venv has installed
    plugins = [("multiturn", trellis_multiturn.plugin), ("example", trellis_example.plugin), ("agent_loops", agent_loops)]
    reg = load_plugins(entry_points=False, extra=plugins).registry
    reg.adding_for("test_multiturn_loop")
    for name, cls in (("checker", Checker), ("raising", Raising), ("slow", Slow)):
        reg.add("interaction", name, cls)
    reg.add("interaction", "constant", Constant)
    for name, cls in (("adder", Adder), ("big", Big), ("broken", Broken)):
        reg.add("tool", name, cls)
    return reg


def test_feedback_turn_is_token_exact_and_masked(registry, tokenizer):
    agent = spec(registry, tokenizer, interactions=[{"name": "check", "component": "checker"}], max_assistant_turns=3)
    engine = ScriptedEngine(tokenizer, ["#### 45", "#### 46"])
    batch = prompts(tokenizer, [row()])
    out = run(engine, agent, batch)

    first = encode_text(tokenizer, "#### 45") + [tokenizer.eos_token_id]
    second = encode_text(tokenizer, "#### 46") + [tokenizer.eos_token_id]
    prompt = batch["input_ids"][0].tolist()
    # the second model turn saw exactly: prompt + its own first turn's ids + the feedback delta
    delta = engine.prompts[1][len(prompt) + len(first) :]
    assert engine.prompts[1][: len(prompt) + len(first)] == prompt + first
    assert tokenizer.decode(delta) == "\n<|im_start|>user\nwrong, try again<|im_end|>\n<|im_start|>assistant\n"
    assert out["responses"][0].tolist() == first + delta + second
    assert out["response_mask"][0].tolist() == [1] * len(first) + [0] * len(delta) + [1] * len(second)
    assert out["rollout_log_probs"][0].tolist() == [-0.25] * len(first) + [0.0] * len(delta) + [-0.25] * len(second)
    assert out["attention_mask"][0].tolist() == [1] * (len(prompt) + len(first) + len(delta) + len(second))
    # the whole sequence is the chat template's rendering of the conversation, token for token
    conversation = [*row()["prompt"], {"role": "assistant", "content": "#### 45"}, {"role": "user", "content": "wrong, try again"},
                    {"role": "assistant", "content": "#### 46"}]  # fmt: skip
    assert tokenizer.decode(out["input_ids"][0].tolist()) == render_chat(tokenizer, conversation, False, {}).rstrip("\n")
    assert out["num_turns"].tolist() == [2] and out["user_turns"].tolist() == [1]
    assert list(out["turn_scores"]) == [[0.0, 1.0]] and list(out["finish_reason"]) == ["done"]
    assert environment_scores(out, "last").tolist() == [1.0] and environment_scores(out, "sum").tolist() == [1.0]
    assert [e for e, _ in EVENTS] == ["start", "respond", "respond", "finalize"]


def test_each_sample_uses_the_interaction_it_names(registry, tokenizer):
    agent = spec(registry, tokenizer, interactions=[{"name": "a", "component": "constant", "options": {}},
                                                    {"name": "b", "component": "checker"}], max_assistant_turns=1)  # fmt: skip
    agent.interactions["a"] = lambda: Constant(0.25)
    rows = [row(interaction_kwargs={"name": "a"}), row(interaction_kwargs={"name": "b", "answer": "45"})]
    out = run(ScriptedEngine(tokenizer, ["#### 45"]), agent, prompts(tokenizer, rows), n=2)
    assert list(out["interaction"]) == ["a", "a", "b", "b"]
    assert [s[-1] for s in out["turn_scores"]] == [0.25, 0.25, 1.0, 1.0]  # "answer" reached the checker's start


def test_unknown_or_missing_interaction_name_is_found_in_the_data(registry, tokenizer):
    names = ["a", "b"]
    with pytest.raises(ConfigError, match=r"data.train_path 'x.parquet': row 1 names interaction 'c'.*configured: a, b"):
        check_interaction_names([row(interaction_kwargs={"name": "a"}), row(interaction_kwargs={"name": "c"})], names, "data.train_path 'x.parquet'")
    with pytest.raises(ConfigError, match=r"row 0 has no extra_info.interaction_kwargs.name, and 2 interactions"):
        check_interaction_names([row()], names, "data")
    check_interaction_names([row()], ["only"], "data")  # one interaction: rows need not name it


def test_interaction_error_ends_the_sample_and_finalizes(registry, tokenizer):
    agent = spec(registry, tokenizer, interactions=[{"name": "r", "component": "raising"}])
    out = run(ScriptedEngine(tokenizer, ["#### 45"]), agent, prompts(tokenizer, [row()]), n=2)
    assert list(out["finish_reason"]) == ["error", "error"] and out["env_errors"].tolist() == [1, 1]
    assert out["response_mask"].sum().item() > 0  # the model's turn is kept
    assert sorted(e for e, _ in EVENTS) == ["finalize", "finalize", "start", "start"]


def test_interaction_timeout_ends_the_sample_and_finalizes(registry, tokenizer):
    agent = spec(registry, tokenizer, interactions=[{"name": "s", "component": "slow", "timeout_s": 0.05}])
    out = run(ScriptedEngine(tokenizer, ["#### 45"]), agent, prompts(tokenizer, [row()]))
    assert list(out["finish_reason"]) == ["error"]
    assert [e for e, _ in EVENTS] == ["start", "finalize"]


def test_cancelled_rollout_finalizes_and_releases(registry, tokenizer):
    agent = spec(registry, tokenizer, interactions=[{"name": "check", "component": "checker"}], tools=[{"component": "adder"}])

    async def cancel_midway():
        engine = ScriptedEngine(tokenizer, ["#### 45"], block=asyncio.Event())  # never set: generation hangs
        task = asyncio.create_task(tool_agent(agent)(engine, prompts(tokenizer, [row()]), SamplingParams(n=3)))
        while len(engine.prompts) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    whats = [e for e, _ in EVENTS]
    assert whats.count("start") == whats.count("finalize") == 3 and whats.count("create") == whats.count("release") == 3


def test_tool_calls_results_errors_and_truncation(registry, tokenizer):
    agent = spec(registry, tokenizer, tools=[{"component": "adder"}, {"component": "big"}, {"component": "broken"}],
                 max_assistant_turns=2, max_tool_response_chars=100, max_response_tokens=2000)  # fmt: skip
    calls = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
             '<tool_call>{"name": "big", "arguments": {}}</tool_call><tool_call>{"name": "broken", "arguments": {}}</tool_call>')  # fmt: skip
    engine = ScriptedEngine(tokenizer, [calls, "done"])
    batch = prompts(tokenizer, [row()], agent.template_kwargs)
    out = run(engine, agent, batch, max_new_tokens=400)
    prompt_len = len(batch["input_ids"][0])
    first_turn = len(encode_text(tokenizer, calls)) + 1
    tool_text = tokenizer.decode(engine.prompts[1][prompt_len + first_turn :])
    assert "<|im_start|>tool\n5<|im_end|>" in tool_text
    assert "x" * 100 + "\n...[truncated 999900 characters]" in tool_text
    assert "Error: tool 'broken' failed: ValueError: no such file" in tool_text
    assert out["tool_calls"].tolist() == [3] and out["tool_errors"].tolist() == [1] and out["malformed_calls"].tolist() == [0]
    assert out["tool_rewards"].tolist() == [0.5] and list(out["finish_reason"]) == ["stop"]
    assert [e for e, _ in EVENTS].count("release") == 3  # one per tool


def test_model_that_never_calls_validly(registry, tokenizer):
    agent = spec(registry, tokenizer, tools=[{"component": "adder"}], max_assistant_turns=3)
    engine = ScriptedEngine(tokenizer, ["<tool_call>not json</tool_call>", '<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "no call"])
    out = run(engine, agent, prompts(tokenizer, [row()]), max_new_tokens=64)
    text = tokenizer.decode(out["responses"][0].tolist())
    assert "Error: the tool call is not valid JSON" in text and "Error: unknown tool 'mul'; available: add" in text
    assert out["malformed_calls"].tolist() == [2] and out["num_turns"].tolist() == [3] and list(out["finish_reason"]) == ["stop"]


@pytest.mark.parametrize(
    ("limits", "finish", "turns"),
    [
        ({"max_assistant_turns": 3, "max_user_turns": 5, "max_response_tokens": 500}, "max_assistant_turns", 3),
        ({"max_assistant_turns": 5, "max_user_turns": 1, "max_response_tokens": 500}, "max_user_turns", 2),
        ({"max_assistant_turns": 5, "max_user_turns": 5, "max_response_tokens": 30}, "max_response_tokens", None),
    ],
)
def test_turn_and_token_limits(registry, tokenizer, limits, finish, turns):
    agent = spec(registry, tokenizer, interactions=[{"name": "c", "component": "checker"}], **limits)
    batch = prompts(tokenizer, [row()])
    out = run(ScriptedEngine(tokenizer, ["#### 45"]), agent, batch)
    assert list(out["finish_reason"]) == [finish]
    if turns is not None:
        assert out["num_turns"].tolist() == [turns] and len(out["turn_scores"][0]) == turns
    response_tokens = int(out["attention_mask"][0].sum() - batch["attention_mask"][0].sum())
    assert response_tokens <= limits["max_response_tokens"]


def test_per_turn_token_limit_comes_out_of_the_budget(registry, tokenizer):
    agent = spec(registry, tokenizer, interactions=[{"name": "c", "component": "checker"}], max_assistant_turns=4, max_user_turns=4,
                 max_response_tokens=12)  # fmt: skip
    out = run(ScriptedEngine(tokenizer, ["#### 45 #### 45 #### 45"]), agent, prompts(tokenizer, [row()]), max_new_tokens=8)
    assert out["response_mask"][0, :8].tolist() == [1] * 8  # the first turn got its full 8
    assert int(out["attention_mask"][0].sum()) - int(prompts(tokenizer, [row()])["attention_mask"][0].sum()) <= 12


def test_bad_sections_name_the_key(registry, tokenizer):
    with pytest.raises(ConfigError, match=r"multi_turn.interactions\[0\]': set exactly one of 'component'"):
        spec(registry, tokenizer, interactions=[{"name": "a"}])
    with pytest.raises(ConfigError, match=r"multi_turn.interactions\[0\].component.*nope"):
        spec(registry, tokenizer, interactions=[{"name": "a", "component": "nope"}])
    with pytest.raises(ConfigError, match=r"multi_turn.tools\[0\].schema' is required for a verl tool"):
        spec(registry, tokenizer, tools=[{"verl_class": "my_pkg.MyTool"}])
    # verl's classes run through trellis-verl-compat's adapter, which this registry lacks (the
    # message adds `pip install trellis-verl-compat` where that package is not installed)
    with pytest.raises(ConfigError, match=r"multi_turn.interactions\[0\].verl_class' names a verl class.*class_adapter 'verl' is not installed"):
        spec(registry, tokenizer, interactions=[{"name": "a", "verl_class": "my_pkg.MyInteraction"}])
    with pytest.raises(ConfigError, match=r"interaction 'a' is configured twice"):
        spec(registry, tokenizer, interactions=[{"name": "a", "component": "checker"}, {"name": "a", "component": "checker"}])
    with pytest.raises(ConfigError, match=r"multi_turn.score' is 'best'"):
        spec(registry, tokenizer, interactions=[{"name": "a", "component": "checker"}], score="best")


def test_many_samples_are_in_flight_at_once(registry, tokenizer):
    """With a slow interaction, 8 conversations overlap instead of running one after another."""
    agent = spec(registry, tokenizer, interactions=[{"name": "c", "component": "checker"}], max_concurrent_samples=8)
    gate = asyncio.Event()
    engine = ScriptedEngine(tokenizer, ["#### 46"], block=gate)

    async def go():
        task = asyncio.create_task(tool_agent(agent)(engine, prompts(tokenizer, [row()]), SamplingParams(n=8)))
        while len(engine.prompts) < 8 and not task.done():
            await asyncio.sleep(0.01)
        in_flight = len(engine.prompts)
        gate.set()
        return in_flight, await task

    in_flight, out = asyncio.run(go())
    assert in_flight == 8 and torch.equal(out["num_turns"], torch.ones(8, dtype=torch.long))


def test_reward_scoring_of_trajectories_keeps_the_rewards_components(registry, tokenizer):
    """score=reward: the reward function sees the whole decoded conversation, and the numbers it
    returns beside ``score`` come back per sample (for estimators such as gdpo)."""
    from trellis_algos.rewards import RewardConfig, RewardManager
    from trellis_multiturn.scoring import score_multiturn

    def turns_seen(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str.count("####")), "feedback": float("wrong, try again" in solution_str),
                "turns": float(extra_info["num_turns"])}  # fmt: skip

    agent = spec(registry, tokenizer, interactions=[{"name": "c", "component": "checker"}], score="reward", max_response_tokens=200)
    batch = prompts(tokenizer, [row(), row("1+2=")])
    out = run(ScriptedEngine(tokenizer, ["#### 45", "#### 46"]), agent, batch, n=2)
    out.update(batch.select("data_source", "ground_truth").repeat_interleave(2))
    if "turns_seen" not in registry.names("reward"):
        registry.add("reward", "turns_seen", turns_seen)
    result = score_multiturn(out, agent.settings, RewardManager(RewardConfig(name="turns_seen"), registry, tokenizer))
    # every conversation: "#### 45" (wrong), the feedback, "#### 46" (what the checker wants)
    assert result.scores.tolist() == [2.0, 2.0, 2.0, 2.0]
    assert result.components["feedback"].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert result.components["turns"].tolist() == [2.0, 2.0, 2.0, 2.0]  # extra_info["num_turns"], as verl's reward functions get it
    assert all("num_turns" not in info for info in out["extra_info"])  # the rows' own extra_info is left as it was
    assert "multiturn/num_turns_mean" in result.metrics


def test_a_loops_own_reward_is_the_samples_reward_under_score_reward(registry, tokenizer):
    """verl's rule for an agent loop's ``reward_score``: where the loop gave one it is the sample's
    reward; the reward function scores only the other samples (and is not called for them)."""
    from trellis_algos.rewards import RewardConfig, RewardManager
    from trellis_multiturn.scoring import score_multiturn

    seen = []

    def hashes(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(solution_str)
        return {"score": float(solution_str.count("####")), "acc": 1.0}

    agent = spec(registry, tokenizer, interactions=[{"name": "c", "component": "checker"}], score="reward", max_response_tokens=200)
    batch = prompts(tokenizer, [row(), row("1+2=")])
    out = run(ScriptedEngine(tokenizer, ["#### 45", "#### 46"]), agent, batch, n=2)
    out.update(batch.select("data_source", "ground_truth").repeat_interleave(2))
    out["agent_rewards"] = torch.tensor([0.0, 0.75, 0.0, -1.0])
    out["agent_scored"] = torch.tensor([False, True, False, True])  # samples 1 and 3: their loop's reward_score
    if "hashes" not in registry.names("reward"):
        registry.add("reward", "hashes", hashes)
    result = score_multiturn(out, agent.settings, RewardManager(RewardConfig(name="hashes"), registry, tokenizer))
    assert result.scores.tolist() == [2.0, 0.75, 2.0, -1.0] and len(seen) == 2
    assert result.components["acc"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert result.metrics["reward/mean"] == (2.0 + 0.75 + 2.0 - 1.0) / 4 and result.metrics["reward/agent_scored"] == 0.5
    last = out["response_mask"].cumsum(-1).argmax(-1)
    assert result.token_scores[torch.arange(4), last].tolist() == [2.0, 0.75, 2.0, -1.0]


def test_rows_pick_their_agent_loop_and_the_environment_may_speak_first(registry, tokenizer):
    """One batch, two loops by the ``agent_name`` column: the row without one runs the default
    (``tool_agent``: answer, feedback, answer); the other runs ``observation_first``, where the
    environment's observation comes before the model's only turn, masked 0."""
    agent = spec(registry, tokenizer, interactions=[{"name": "check", "component": "checker"}], max_response_tokens=200)
    observed = {**row("1+2=", observation="wrong"), "agent_name": "observation_first"}
    batch = prompts(tokenizer, [row(), observed])
    fn = agent_rollout(agent, registry, {"data": [(0, None), (1, "observation_first")]})
    assert set(fn.loops) == {"tool_agent", "observation_first"}
    engine = ScriptedEngine(tokenizer, ["#### 45", "#### 46"])
    out = asyncio.run(fn(engine, batch, SamplingParams(n=1, max_new_tokens=16)))

    assert list(out["agent_name"]) == ["tool_agent", "observation_first"]
    assert list(out["finish_reason"]) == ["done", "answered"] and out["num_turns"].tolist() == [2, 1]
    prompt = batch["input_ids"][1][batch["attention_mask"][1].bool()].tolist()
    env = encode_text(tokenizer, "<|im_end|>\n<|im_start|>user\nwrong<|im_end|>\n<|im_start|>assistant\n")
    answer = encode_text(tokenizer, "#### 46") + [tokenizer.eos_token_id]  # the script's second turn: it saw two generation prompts
    assert prompt + env in engine.prompts and prompt not in engine.prompts  # the model's first turn came after the observation
    length = len(env) + len(answer)
    assert out["responses"][1, :length].tolist() == env + answer
    assert out["response_mask"][1].tolist() == [0] * len(env) + [1] * len(answer) + [0] * (out["responses"].shape[1] - length)
    assert out["rollout_log_probs"][1, :length].tolist() == [0.0] * len(env) + [-0.25] * len(answer)
    conversation = [*observed["prompt"], {"role": "assistant", "content": ""}, {"role": "user", "content": "wrong"},
                    {"role": "assistant", "content": "#### 46"}]  # fmt: skip
    sequence = out["input_ids"][1][out["attention_mask"][1].bool()].tolist()
    assert tokenizer.decode(sequence) == render_chat(tokenizer, conversation, False, {}).rstrip("\n")
    assert list(out["turn_scores"]) == [[0.0, 1.0], [1.0]] and out["user_turns"].tolist() == [1, 1]


def test_unknown_agent_loop_is_named_with_the_row_and_the_installed_loops(registry, tokenizer):
    agent = spec(registry, tokenizer, interactions=[{"name": "check", "component": "checker"}])
    installed = "example_one_turn, observation_first, retokenized, tool_agent"
    with pytest.raises(ConfigError, match=rf"data.train_path 'x.parquet': row 2 has agent_name='react', which is not an installed agent "
                                          rf"loop \(installed: {installed}\)"):  # fmt: skip
        agent_rollout(agent, registry, {"data.train_path 'x.parquet'": [(0, None), (1, "tool_agent"), (2, "react")]})
    agent.settings.agent_loop = "tool_agnet"
    with pytest.raises(ConfigError, match=r"config key 'multi_turn.agent_loop': agent_loop 'tool_agnet' is not installed.*did you mean 'tool_agent'"):
        agent_rollout(agent, registry)


def test_an_environment_class_runs_one_object_per_sample_through_tool_agent(registry, tokenizer):
    """``multi_turn.environment``: each sample's object is reset from its row's ``extra_info``, the
    model's calls reach its methods (a bad argument goes back as an error), and its ``reward()``
    becomes the sample's ``agent_rewards``, which ``environment_scores`` adds."""
    import environments

    environments.RESETS.clear()
    agent = spec(registry, tokenizer, environment="environments:GuessSum", max_assistant_turns=3, max_response_tokens=2000)
    assert [s["function"]["name"] for s in agent.template_kwargs["tools"]] == ["guess", "hint"]
    calls = ['<tool_call>{"name": "guess", "arguments": {"number": 45}}</tool_call>'
             '<tool_call>{"name": "guess", "arguments": {"guess": 1}}</tool_call>',
             '<tool_call>{"name": "guess", "arguments": {"number": 46}}</tool_call>', "done"]  # fmt: skip
    batch = prompts(tokenizer, [{**row(), "extra_info": {"question": "12+34=", "index": 7}}], agent.template_kwargs)
    out = run(ScriptedEngine(tokenizer, calls), agent, batch, n=2, max_new_tokens=400)
    assert environments.RESETS == [{"question": "12+34=", "noisy": False}] * 2  # reset takes only the fields it names
    text = tokenizer.decode(out["responses"][0].tolist())
    assert "<|im_start|>tool\nhigher<|im_end|>" in text and "<|im_start|>tool\nright<|im_end|>" in text
    assert "Error: tool 'guess' failed: TypeError:" in text and "unexpected keyword argument 'guess'" in text
    assert out["tool_calls"].tolist() == [3, 3] and out["tool_errors"].tolist() == [1, 1] and list(out["finish_reason"]) == ["stop"] * 2
    # per sample: two guesses counted (0.5) and one was right (+1); samples do not share an object
    assert out["agent_rewards"].tolist() == [1.5, 1.5] and environment_scores(out, "last").tolist() == [1.5, 1.5]


def test_an_environment_whose_reset_fails_ends_the_sample(registry, tokenizer):
    import environments

    agent = spec(registry, tokenizer, environment=f"{environments.__file__}:GuessSum")
    out = run(ScriptedEngine(tokenizer, ["done"]), agent, prompts(tokenizer, [{**row(), "extra_info": {"question": "no sum"}}]))
    assert list(out["finish_reason"]) == ["error"] and out["env_errors"].tolist() == [1] and out["agent_rewards"].tolist() == [0.0]


# Like published reasoning templates: an assistant turn before the last user turn loses its
# <think>...</think> when the history is rendered again (written for this test).


def test_a_template_that_strips_reasoning_from_history_still_trains_on_the_sampled_ids(registry):
    """tool_agent appends the feedback as ChatDeltas renders it after the model's own ids, so the
    first turn keeps its <think> (as sampled) and passes the sampled-ids check; rendering the whole
    conversation with the template and re-encoding it, as a re-tokenising loop would, drops that
    reasoning and fails the check at the first trained token."""
    tokenizer = make_tiny_tokenizer(["<think>45 or 47?</think>#### 45 wrong, try again <think>so 46</think>#### 46 12+34="] * 20)
    tokenizer.chat_template = REASONING_TEMPLATE
    agent = spec(registry, tokenizer, interactions=[{"name": "check", "component": "checker"}], max_assistant_turns=3)
    turns = ["<think>45 or 47?</think>#### 45", "<think>so 46</think>#### 46"]
    batch = prompts(tokenizer, [row()])
    out = run(ScriptedEngine(tokenizer, turns), agent, batch, max_new_tokens=200)  # the rollout runs the sampled-ids check

    first, second = (encode_text(tokenizer, t) + [tokenizer.eos_token_id] for t in turns)
    first, second = Generation(first, [-0.25] * len(first), "stop"), Generation(second, [-0.25] * len(second), "stop")
    feedback = [{"role": "user", "content": "wrong, try again"}]
    delta = ChatDeltas(tokenizer).after_model(first.token_ids, feedback)
    assert tokenizer.decode(delta) == "\n<|im_start|>user\nwrong, try again<|im_end|>\n<|im_start|>assistant\n"
    assert out["responses"][0].tolist() == first.token_ids + delta + second.token_ids
    assert out["response_mask"][0].tolist() == [1] * len(first.token_ids) + [0] * len(delta) + [1] * len(second.token_ids)
    assert list(out["turn_scores"]) == [[0.0, 1.0]]

    conversation = [*row()["prompt"], {"role": "assistant", "content": turns[0]}, *feedback, {"role": "assistant", "content": turns[1]}]
    prompt = batch["input_ids"][0].tolist()
    rerendered = encode_text(tokenizer, render_chat(tokenizer, conversation, False, {}))[len(prompt) :]
    assert tokenizer.decode(rerendered).startswith("#### 45<|im_end|>")  # the template dropped the first turn's reasoning
    cut = rerendered.index(tokenizer.eos_token_id) + 1
    retokenized = Trajectory()
    retokenized.add_model(Generation(rerendered[:cut], [-0.25] * cut, "stop"))
    retokenized.add_environment(delta)
    retokenized.add_model(second)
    with pytest.raises(NotSampled, match=r"agent loop 're-rendered' trains on token \d+ .* at response position 0"):
        check_sampled(retokenized, [first, second], "re-rendered", tokenizer)
    sampled = Trajectory()
    sampled.add_model(first)
    sampled.add_environment(delta)
    sampled.add_model(second)
    check_sampled(sampled, [first, second], "tool_agent", tokenizer)
