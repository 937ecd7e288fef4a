"""verl 0.9.1 agent loops run unchanged: a user's ``AgentLoopBase`` subclass, written against
verl's own classes (installed ``--no-deps``), trains in an rl run through trellis-interactions'
``verl`` agent loop; the trained ids are the ids the engine sampled and the loop's reward reaches
the batch."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from uuid import uuid4

import pytest

pytest.importorskip("verl.experimental.agent_loop", reason="verl 0.9.1 and what its agent loop module imports (see noxfile.py)")

from multiturn_runs import multi_turn_run
from transformers import AutoTokenizer  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register  # noqa: E402
from verl.utils.profiler import simple_timer  # noqa: E402

import trellis_algos.rl.samples as rl  # noqa: E402
import trellis_verl_compat.agent_loop as adapter  # noqa: E402
from trellis.config import ConfigError  # noqa: E402
from trellis.interfaces.rollout import Generation  # noqa: E402
from trellis.recipes.train import train  # noqa: E402
from trellis_demo.tasks import make_arithmetic_split, write_rows  # noqa: E402

CHECK = "Check your answer."
SEEN_FIELDS: list[dict[str, Any]] = []  # the keyword arguments each run got


@register("check_again_agent")
class CheckAgainAgentLoop(AgentLoopBase):
    """A user's loop in verl 0.9.1's style: the model answers, the user asks it to check its
    answer, the model answers again; the reward is a tenth of the last reply's length in characters."""

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        SEEN_FIELDS.append(kwargs)
        messages = list(kwargs["raw_prompt"])
        metrics: dict[str, Any] = {}
        request_id = uuid4().hex
        prompt_ids = await self.ct_build_initial_tokens(messages)
        runtime_ids, response_mask, response_logprobs = list(prompt_ids), [], []
        reply = ""
        for turn in range(2):
            with simple_timer("generate_sequences", metrics):
                output = await self.server_manager.generate(request_id=request_id, prompt_ids=runtime_ids, sampling_params=sampling_params)
            merged, response_mask, response_logprobs = await self.ct_merge_assistant_token(
                runtime_ids, output.token_ids, response_mask, response_logprobs, assistant_logprobs=output.log_probs
            )
            runtime_ids = merged.token_ids
            reply = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
            if turn == 0:
                previous = list(messages)
                messages.append({"role": "user", "content": CHECK})
                merged, response_mask, response_logprobs = await self.ct_merge_context_msg(
                    previous, messages, runtime_ids, response_mask, response_logprobs
                )
                runtime_ids = merged.token_ids
        response_length = self.rollout_config.response_length
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=runtime_ids[len(prompt_ids) :][:response_length],
            response_mask=response_mask[:response_length],
            response_logprobs=response_logprobs[:response_length],
            reward_score=len(reply) / 10,
            num_turns=4,
            metrics=metrics,
            extra_fields={"turn_scores": [], "tool_rewards": []},
        )


LOOP = {"name": "check_again_agent", "component": "verl", "options": {"verl_class": f"{__name__}.CheckAgainAgentLoop"}}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # a column of the user's own beside verl's (verl hands a loop every column of its row)
    rows = [{**row, "agent_name": "check_again_agent", "difficulty": i % 3} for i, row in enumerate(make_arithmetic_split(16, 0, max_value=30))]
    return str(write_rows(rows, tmp_path_factory.mktemp("data") / "train.parquet"))


def overrides(model, data, run_dir, loops):
    return multi_turn_run(model, data, run_dir, "multi_turn.max_response_tokens=64", f"multi_turn.agent_loops={json.dumps(loops)}")


def test_a_verl_agent_loop_trains_on_what_the_engine_sampled(tiny_model_path, data, tmp_path, monkeypatch):
    """Two rl steps of 4 prompts x 2 samples, each an episode of the user's loop: the batch's
    trained tokens are its two sampled turns with the engine's log-probs, the user's turn between
    them has mask 0, and its reward is what the loop returned."""
    episodes, batches = [], []
    trajectory, sample = adapter.trajectory, rl.sample

    def keep_episode(output, prompt_ids, calls, loop):
        episodes.append((output, prompt_ids, list(calls)))
        return trajectory(output, prompt_ids, calls, loop)

    def keep_batch(*args, **kwargs):
        batches.append(sample(*args, **kwargs))
        return batches[-1]

    monkeypatch.setattr(adapter, "trajectory", keep_episode)
    monkeypatch.setattr(rl, "sample", keep_batch)
    train(None, overrides(tiny_model_path, data, tmp_path / "run", [LOOP]))

    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in r]
    assert len(steps) == 2 and len(batches) == 2 and len(episodes) == 2 * 4 * 2
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for step, batch in enumerate(batches):
        assert steps[step]["multiturn/num_turns_mean"] == 2.0 and steps[step]["multiturn/env_errors"] == 0
        mine = {tuple(e[1] + e[0].response_ids): e for e in episodes[step * 8 : (step + 1) * 8]}
        for i in range(len(batch)):
            full = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
            output, prompt_ids, calls = mine.pop(tuple(full))  # the trained sequence is the episode's, token for token
            (first_context, first), (second_context, second) = calls
            assert second_context[: len(first_context) + len(first.token_ids)] == first_context + first.token_ids
            assert first_context == prompt_ids  # the loop's own rendering of the row is trellis's
            mask = batch["response_mask"][i].bool()
            assert batch["responses"][i][mask].tolist() == first.token_ids + second.token_ids
            assert batch["rollout_log_probs"][i][mask].tolist() == pytest.approx(first.log_probs + second.log_probs, abs=0)
            between = tokenizer.decode(second_context[len(first_context) + len(first.token_ids) :])
            assert CHECK in between and between.endswith("<|im_start|>assistant\n")
            reply = tokenizer.decode(second.token_ids, skip_special_tokens=True)
            assert batch["agent_rewards"][i].item() == pytest.approx(len(reply) / 10) and batch["agent_scored"][i]
        assert not mine
        assert steps[step]["reward/mean"] == pytest.approx(batch["agent_rewards"].mean().item(), abs=1e-6)
    # every column of the row reaches the loop, as verl passes them (a loop reads reward_model, data_source...)
    columns = {"raw_prompt", "extra_info", "data_source", "reward_model", "agent_name", "tools_kwargs", "interaction_kwargs", "index"}
    assert SEEN_FIELDS and all(columns - {"agent_name"} <= set(seen) for seen in SEEN_FIELDS), set(SEEN_FIELDS[0])
    assert all(seen["difficulty"] in (0, 1, 2) for seen in SEEN_FIELDS)  # the user's own column
    assert all(seen["reward_model"]["style"] == "rule" for seen in SEEN_FIELDS)  # the row's reward_model whole, as verl passes it


def test_a_verl_loop_is_configured_by_name_and_checked_before_any_model_is_built(tiny_model_path, data, tmp_path):
    bad = {**LOOP, "options": {"verl_class": f"{__name__}.CHECK"}}
    refused = r"multi_turn.agent_loops\[0\].options': verl_class .*CHECK' is not a subclass of verl.experimental.agent_loop.AgentLoopBase"
    with pytest.raises(ConfigError, match=refused):
        train(None, overrides(tiny_model_path, data, tmp_path / "bad", [bad]))
    with pytest.raises(ConfigError, match=r"row 0 has agent_name='check_again_agent', which is not an installed agent loop"):
        train(None, overrides(tiny_model_path, data, tmp_path / "bad", [{**LOOP, "name": "other"}]))
    with pytest.raises(ConfigError, match=r"multi_turn.agent_loops\[0\].name' is 'tool_agent', which names another agent loop already"):
        train(None, overrides(tiny_model_path, data, tmp_path / "bad", [{**LOOP, "name": "tool_agent"}]))
    with pytest.raises(ConfigError, match=r"'multi_turn.agent_loop': agent loop 'verl' runs only with options; add an entry"):
        train(None, [*overrides(tiny_model_path, data, tmp_path / "bad", [LOOP]), "multi_turn.agent_loop=verl"])
    assert not (tmp_path / "bad").exists()


def output(prompt, response, mask, log_probs=None):
    return AgentLoopOutput(prompt_ids=prompt, response_ids=response, response_mask=mask, response_logprobs=log_probs, num_turns=3, metrics={})


def test_an_output_must_hold_the_rows_prompt_and_the_contexts_its_turns_were_sampled_after():
    turn = Generation([7, 8], [-0.5, -0.25], "stop")
    calls = [([1, 2], turn), ([1, 2, 7, 8, 5], Generation([9], [-1.0], "length"))]
    traj = adapter.trajectory(output([1, 2], [7, 8, 5, 9], [1, 1, 0, 1]), [1, 2], calls, "Mine")
    # no response_logprobs: the engine's, matched in order; the environment's token gets 0
    assert (traj.log_probs, traj.assistant_turns, traj.user_turns, traj.finish) == ([-0.5, -0.25, 0.0, -1.0], 2, 0, "length")
    with pytest.raises(ValueError, match=r"'Mine' returned prompt_ids of 3 tokens that differ from the row's prompt .* \(2 tokens\) from position 2"):
        adapter.trajectory(output([1, 2, 3], [7, 8, 5, 9], [1, 1, 0, 1]), [1, 2], calls, "Mine")
    with pytest.raises(ValueError, match=r"'Mine': model turn 2 was sampled after ids that are not the trajectory's"):
        adapter.trajectory(output([1, 2], [7, 8, 6, 9], [1, 1, 0, 1]), [1, 2], calls, "Mine")  # the environment's token re-rendered


def test_verls_own_helpers_run_inline_and_a_users_blocking_call_in_the_executor():
    """A verl loop's ``self.loop``: a function of verl's modules (its token helpers) runs on the event
    loop's thread, its error raised where it is awaited; any other function goes to the executor."""
    import threading

    def ids():
        return threading.get_ident()

    def verl_helper():
        return threading.get_ident()

    def verl_failure():
        raise ValueError("merge failed")

    verl_helper.__module__ = verl_failure.__module__ = "verl.experimental.agent_loop.agent_loop"

    async def main():
        loop = adapter.HelperLoop(asyncio.get_running_loop())
        here = threading.get_ident()
        assert await loop.run_in_executor(None, verl_helper) == here
        assert await loop.run_in_executor(None, ids) != here  # a user's function: the executor's thread
        with pytest.raises(ValueError, match="merge failed"):
            await loop.run_in_executor(None, verl_failure)
        assert loop.time() > 0  # everything else is the event loop's

    asyncio.run(main())
