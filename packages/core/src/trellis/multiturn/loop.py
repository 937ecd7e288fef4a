"""The agent loop: each sample a conversation of model turns (the engine's async generation) and
environment turns (an interaction's reply or tool results), many samples in flight at once."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from trellis.batch import Batch
from trellis.interfaces.rollout import Generation, RolloutEngine, SamplingParams, pad_id, rollout_batch
from trellis.multiturn.chat import ChatDeltas
from trellis.multiturn.environment import AgentSpec, Environment, interaction_name
from trellis.multiturn.tool_calls import ToolCall

log = logging.getLogger("trellis")

FINISH_REASONS = ("done", "stop", "max_assistant_turns", "max_user_turns", "max_response_tokens", "error")


class EnvironmentFailure(RuntimeError):
    """An interaction failed or timed out: the sample ends (its turns so far are kept)."""


@dataclass
class Trajectory:
    """One conversation after the prompt: every token (model and environment), which are the
    model's (mask 1, with their rollout log-probs), the interaction's turn scores and counters."""

    interaction: str = ""
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    tool_reward: float = 0.0
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    malformed_calls: int = 0
    finish: str = ""
    error: str = ""

    def add_model(self, gen: Generation) -> None:
        self.response_ids += gen.token_ids
        self.response_mask += [1] * len(gen.token_ids)
        self.log_probs += gen.log_probs
        self.assistant_turns += 1

    def add_environment(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)


class AgentLoop:
    """Runs conversations on ``engine`` with the environment ``spec`` describes.

    A sample ends when the interaction says it is done, when a model turn neither calls a tool
    nor has an interaction to answer it (``stop``), or at ``max_assistant_turns``,
    ``max_user_turns`` (interaction replies fed back) or ``max_response_tokens``. The interaction
    scores every model turn, the last one included; only replies that are fed back count as user
    turns. ``finalize`` and ``release`` always run: on success, error, timeout and cancellation.
    """

    def __init__(self, engine: RolloutEngine, spec: AgentSpec) -> None:
        self.engine = engine
        self.spec = spec
        self.settings = spec.settings
        self.tokenizer = spec.tokenizer
        self.chat = ChatDeltas(spec.tokenizer, spec.template_kwargs)
        self.env = Environment(spec)
        self._logged_error = False

    async def run(self, prompts: Batch, params: SamplingParams) -> Batch:
        """``params.n`` conversations per prompt; the ``rollout_batch`` layout (response attention
        1 on every token, ``response_mask`` 1 on the model's) plus per-sample ``num_turns``,
        ``user_turns``, ``tool_calls``, ``tool_errors``, ``malformed_calls``, ``tool_rewards``,
        ``env_errors``, and ``turn_scores``, ``interaction``, ``finish_reason`` (Python fields).

        prompts: left-padded ``input_ids`` / ``attention_mask`` ``(batch, prompt_len)`` with
        ``raw_prompt`` (chat messages) and ``extra_info`` per prompt."""
        limit = asyncio.Semaphore(self.settings.max_concurrent_samples)
        jobs = []
        for i in range(len(prompts)):
            ids = prompts["input_ids"][i][prompts["attention_mask"][i].bool()].tolist()
            for j in range(params.n):
                one = dataclasses.replace(params, n=1, seed=params.sample_seed(i * params.n + j))
                jobs.append(self._limited(limit, ids, prompts["raw_prompt"][i], prompts["extra_info"][i], one))
        trajectories = await asyncio.gather(*jobs)
        return assemble(prompts, params, trajectories, pad_id(self.tokenizer))

    async def _limited(self, limit: asyncio.Semaphore, *args: Any) -> Trajectory:
        async with limit:
            return await self.sample(*args)

    async def sample(self, prompt_ids: list[int], raw_prompt: list[dict], extra_info: dict | None, params: SamplingParams) -> Trajectory:
        """One conversation from ``prompt_ids`` (the rendered ``raw_prompt``)."""
        s = self.settings
        extra_info = extra_info or {}
        traj = Trajectory(interaction=interaction_name(extra_info, list(self.env.interactions)) or "")
        interaction = self.env.interactions.get(traj.interaction)
        timeout = self._interaction_timeout(traj.interaction)
        instance = uuid.uuid4().hex
        messages = [dict(m) for m in raw_prompt]
        budget = s.max_response_tokens or params.max_new_tokens * s.max_assistant_turns
        started: list[tuple[Any, float]] = []  # (finalize / release, timeout), run in reverse at the end
        try:
            if interaction is not None:
                started.append((interaction.finalize, timeout))  # also when start fails part-way
                kwargs = {k: v for k, v in (extra_info.get("interaction_kwargs") or {}).items() if k != "name"}
                await self._env(interaction.start(instance, **kwargs), timeout, "start")
            tools_kwargs = extra_info.get("tools_kwargs") or {}
            for name, tool in self.env.tools.items():
                tool_timeout = self.env.tool_configs[name].timeout_s
                started.append((tool.release, tool_timeout))
                create_kwargs = (tools_kwargs.get(name) or {}).get("create_kwargs") or {}
                await self._env(tool.create(instance, **create_kwargs), tool_timeout, f"tool {name!r} create")
            while True:
                turn_params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, budget - len(traj.response_ids)))
                gen = await self.engine.agenerate(prompt_ids + traj.response_ids, turn_params)
                traj.add_model(gen)
                # decoded to be read by the environment only; the trajectory keeps the ids
                messages.append({"role": "assistant", "content": self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)})
                calls = self.env.parser.parse(messages[-1]["content"]) if self.env.tools else []
                if calls:
                    reply = await self._tools(instance, calls, traj)
                elif interaction is not None:
                    turn = await self._env(interaction.respond(instance, messages), timeout, "reply")
                    traj.turn_scores.append(float(turn.score))
                    if turn.done:
                        traj.finish = "done"
                        break
                    if traj.user_turns >= s.max_user_turns:
                        traj.finish = "max_user_turns"
                        break
                    reply = [{"role": "user", "content": turn.message}]
                else:
                    traj.finish = "stop"
                    break
                if traj.assistant_turns >= s.max_assistant_turns:
                    traj.finish = "max_assistant_turns"
                    break
                delta = self.chat.after_model(gen.token_ids, reply)
                if len(traj.response_ids) + len(delta) >= budget:  # no room left for a model turn
                    traj.finish = "max_response_tokens"
                    break
                traj.add_environment(delta)
                traj.user_turns += reply[0]["role"] == "user"
                messages.extend(reply)
        except EnvironmentFailure as exc:
            traj.finish, traj.error = "error", str(exc)
            self._log_error(exc)
        finally:
            for close, close_timeout in reversed(started):
                await _close(close, instance, close_timeout)
        return traj

    async def _tools(self, instance: str, calls: list[ToolCall], traj: Trajectory) -> list[dict[str, str]]:
        """Run a turn's calls concurrently; every outcome (result, bad call, exception, timeout)
        goes back to the model as a ``tool`` message, truncated with a visible marker."""
        results = await asyncio.gather(*(self._call(instance, c, traj) for c in calls))
        traj.tool_calls += len(calls)
        return [{"role": "tool", "content": truncate(text, self.settings.max_tool_response_chars)} for text in results]

    async def _call(self, instance: str, call: ToolCall, traj: Trajectory) -> str:
        if call.error is not None or call.name not in self.env.tools:
            traj.malformed_calls += 1
            known = ", ".join(self.env.tools)
            return f"Error: {call.error or f'unknown tool {call.name!r}; available: {known}'}"
        tool, cfg = self.env.tools[call.name], self.env.tool_configs[call.name]
        limit = self.env.limits.get(call.name)
        try:
            if limit is None:
                result = await asyncio.wait_for(tool.execute(instance, call.arguments), cfg.timeout_s)
            else:
                async with limit:
                    result = await asyncio.wait_for(tool.execute(instance, call.arguments), cfg.timeout_s)
        except asyncio.TimeoutError:
            traj.tool_errors += 1
            return f"Error: tool {call.name!r} timed out after {cfg.timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - the model is told, the run goes on
            traj.tool_errors += 1
            return f"Error: tool {call.name!r} failed: {type(exc).__name__}: {exc}"
        traj.tool_reward += float(result.reward)
        return result.text

    async def _env(self, coro: Any, timeout: float, what: str) -> Any:
        try:
            return await asyncio.wait_for(coro, timeout)
        except asyncio.TimeoutError:
            raise EnvironmentFailure(f"{what} timed out after {timeout:g} s") from None
        except Exception as exc:
            raise EnvironmentFailure(f"{what} failed: {type(exc).__name__}: {exc}") from exc

    def _interaction_timeout(self, name: str) -> float:
        return next((c.timeout_s for c in self.settings.interactions if c.name == name), 60.0)

    def _log_error(self, exc: Exception) -> None:
        if not self._logged_error:
            self._logged_error = True
            cause = exc.__cause__ or exc
            log.error(
                "multi-turn: a sample's interaction failed; the sample ends there and counts in multiturn/env_errors "
                "(later failures are counted, not logged)\n%s",
                "".join(traceback.format_exception(type(cause), cause, cause.__traceback__)),
            )

async def _close(close: Any, instance: str, timeout: float) -> None:
    """Run one ``finalize`` / ``release``; a failure is logged and the others still run."""
    try:
        await asyncio.wait_for(close(instance), timeout)
    except Exception as exc:  # noqa: BLE001 - one failed clean-up must not stop the others
        log.warning("multi-turn: %s of %s failed: %s: %s", close.__name__, type(close.__self__).__name__, type(exc).__name__, exc)


def truncate(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with a marker that says how much was dropped."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n...[truncated {len(text) - limit} characters]"


def assemble(prompts: Batch, params: SamplingParams, trajectories: list[Trajectory], pad_id: int) -> Batch:
    """The ``rollout_batch`` layout from ``trajectories`` (prompt i's at rows i*n .. i*n+n-1)."""
    width = max((len(t.response_ids) for t in trajectories), default=0)
    n = len(trajectories)
    responses = torch.full((n, width), pad_id, dtype=prompts["input_ids"].dtype)
    mask = torch.zeros(n, width, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    log_probs = torch.zeros(n, width, dtype=torch.float32)
    for i, t in enumerate(trajectories):
        length = len(t.response_ids)
        responses[i, :length] = torch.tensor(t.response_ids, dtype=responses.dtype)
        mask[i, :length] = torch.tensor(t.response_mask)
        attention[i, :length] = 1
        log_probs[i, :length] = torch.tensor(t.log_probs, dtype=torch.float32)
    out = rollout_batch(prompts, params, responses, mask, log_probs, response_attention=attention)

    def counts(attr: str) -> torch.Tensor:
        return torch.tensor([getattr(t, attr) for t in trajectories], dtype=torch.long)

    out["num_turns"] = counts("assistant_turns")
    for key in ("user_turns", "tool_calls", "tool_errors", "malformed_calls"):
        out[key] = counts(key)
    out["env_errors"] = torch.tensor([t.finish == "error" for t in trajectories], dtype=torch.long)
    out["tool_rewards"] = torch.tensor([t.tool_reward for t in trajectories], dtype=torch.float32)
    out["turn_scores"] = [list(t.turn_scores) for t in trajectories]
    out["interaction"] = [t.interaction for t in trajectories]
    out["finish_reason"] = [t.finish for t in trajectories]
    return out


def environment_scores(batch: Batch, score: str) -> torch.Tensor:
    """Per-sample scores ``(batch,)`` from the environment: the last interaction turn's score
    (``last``) or their sum (``sum``), plus the sample's tool rewards."""
    turns = [list(s) for s in batch["turn_scores"]]
    base = [(s[-1] if s else 0.0) if score == "last" else sum(s) for s in turns]
    return torch.tensor(base, dtype=torch.float32) + batch["tool_rewards"]


def multiturn_metrics(batch: Batch) -> dict[str, float]:
    """``multiturn/...``: turns per sample, tool calls and failures, interaction errors, and the
    fraction of samples that ended for each reason."""
    n = max(len(batch), 1)
    out = {
        "multiturn/num_turns_mean": float(batch["num_turns"].float().mean()),
        "multiturn/num_turns_max": float(batch["num_turns"].max()) if len(batch) else 0.0,
        "multiturn/user_turns_mean": float(batch["user_turns"].float().mean()),
        "multiturn/tool_calls": float(batch["tool_calls"].sum()),
        "multiturn/tool_errors": float(batch["tool_errors"].sum()),
        "multiturn/malformed_calls": float(batch["malformed_calls"].sum()),
        "multiturn/env_errors": float(batch["env_errors"].sum()),
    }
    reasons = list(batch["finish_reason"])
    out.update({f"multiturn/finish_{r}": reasons.count(r) / n for r in FINISH_REASONS if r in reasons})
    return out
