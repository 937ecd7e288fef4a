"""Core's agent loop ``tool_agent`` (the default of kind ``agent_loop``): model turns (the engine's
async generation) answered by an interaction's reply or tool results until one side ends it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import traceback
import uuid
from typing import Any

from trellis import AgentLoop, RolloutEngine, SamplingParams, Trajectory
from trellis.kit.multiturn import join_images, with_images
from trellis_multiturn.chat import ChatDeltas
from trellis_multiturn.environment import AgentSpec, Environment, interaction_name
from trellis_multiturn.tool_calls import ToolCall

log = logging.getLogger("trellis")


class EnvironmentFailure(RuntimeError):
    """An interaction failed or timed out: the sample ends (its turns so far are kept)."""


class ToolAgentLoop(AgentLoop):
    """Conversations with the configured interactions and tools (registered as ``tool_agent``).

    A sample ends when the interaction says it is done, when a model turn neither calls a tool
    nor has an interaction to answer it (``stop``), or at ``max_assistant_turns``,
    ``max_user_turns`` (interaction replies fed back) or ``max_response_tokens``. The interaction
    scores every model turn, the last one included; only replies that are fed back count as user
    turns. ``finalize`` and ``release`` always run: on success, error, timeout and cancellation.
    With an environment class, each sample gets its own object (``reset`` first; its ``reward()``
    after the last turn, as the sample's ``agent_reward``).
    """

    runs_tools = True
    takes_images = True

    def __init__(self, engine: RolloutEngine, spec: AgentSpec, env: Environment) -> None:
        super().__init__(engine, spec, env)
        self.chat = ChatDeltas(spec.tokenizer, spec.template_kwargs)
        self._logged_error = False

    async def sample(
        self, prompt_ids: list[int], raw_prompt: list[dict], extra_info: dict, params: SamplingParams, images: dict | None = None
    ) -> Trajectory:
        s = self.settings
        traj = Trajectory(interaction=interaction_name(extra_info, list(self.env.interactions)) or "")
        interaction = self.env.interactions.get(traj.interaction)
        timeout = self._interaction_timeout(traj.interaction)
        instance = uuid.uuid4().hex
        messages = [dict(m) for m in raw_prompt]
        budget = s.response_budget(params.max_new_tokens)
        started: list[tuple[Any, float]] = []  # (finalize / release, timeout), run in reverse at the end
        try:
            if interaction is not None:
                started.append((interaction.finalize, timeout))  # also when start fails part-way
                kwargs = {k: v for k, v in (extra_info.get("interaction_kwargs") or {}).items() if k != "name"}
                await self._env(interaction.start(instance, **kwargs), timeout, "start")
            episodes, env_timeout = self.env.episodes, s.environment_timeout_s
            if episodes is not None:
                started.append((episodes.close, env_timeout))
                await self._env(episodes.open(instance, extra_info), env_timeout, "environment reset")
            tools_kwargs = extra_info.get("tools_kwargs") or {}
            for name, tool in self.env.tools.items():
                tool_timeout = self.env.tool_configs[name].timeout_s
                started.append((tool.release, tool_timeout))
                create_kwargs = (tools_kwargs.get(name) or {}).get("create_kwargs") or {}
                await self._env(tool.create(instance, **create_kwargs), tool_timeout, f"tool {name!r} create")
            while True:
                turn_params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, budget - len(traj.response_ids)))
                shown = join_images(images or {}, traj.image_inputs)  # the prompt's images, then those tools returned
                gen = await self.engine.agenerate(prompt_ids + traj.response_ids, turn_params, **with_images(shown))
                traj.add_model(gen)
                # decoded to be read by the environment only; the trajectory keeps the ids
                messages.append({"role": "assistant", "content": self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)})
                calls = self.env.parser.parse(messages[-1]["content"]) if self.env.tools else []
                returned: list[Any] = []  # images the turn's tool results show the model
                if calls:
                    reply, returned = await self._tools(instance, calls, traj)
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
                delta, seen = self._environment_turn(gen.token_ids, reply, returned, traj)
                if len(traj.response_ids) + len(delta) >= budget:  # no room left for a model turn
                    traj.finish = "max_response_tokens"
                    break
                traj.add_environment(delta, seen)
                traj.user_turns += reply[0]["role"] == "user"
                messages.extend(reply)
            if episodes is not None:
                traj.agent_reward = await self._env(episodes.reward(instance), env_timeout, "environment reward()")
        except EnvironmentFailure as exc:
            traj.finish, traj.error = "error", str(exc)
            self._log_error(exc)
        finally:
            for close, close_timeout in reversed(started):
                await _close(close, instance, close_timeout)
        return traj

    def _environment_turn(self, model_ids: list[int], reply: list[dict], images: list[Any], traj: Trajectory) -> tuple[list[int], dict]:
        """The token ids after a model turn and the processed images they show (a vision-language
        model's prompt encoder expands each image's placeholder)."""
        if not images:
            return self.chat.after_model(model_ids, reply), {}
        text = self.chat.text_after_model(model_ids, reply)
        return self.spec.images.encode_turn(text, images, f"turn {traj.assistant_turns}'s tool results")

    async def _tools(self, instance: str, calls: list[ToolCall], traj: Trajectory) -> tuple[list[dict], list[Any]]:
        """Run a turn's calls concurrently; every outcome (result, bad call, exception, timeout)
        goes back to the model as a ``tool`` message, truncated with a visible marker, its images
        (a vision-language model's) before its text; also every image, in order."""
        results = await asyncio.gather(*(self._call(instance, c, traj) for c in calls))
        traj.tool_calls += len(calls)
        messages = []
        for text, images in results:
            text = truncate(text, self.settings.max_tool_response_chars)
            messages.append({"role": "tool", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}] if images else text})
        return messages, [image for _, images in results for image in images]

    async def _call(self, instance: str, call: ToolCall, traj: Trajectory) -> tuple[str, list[Any]]:
        """One call's text for the model and the images it returned (none on an error)."""
        if call.error is not None or call.name not in self.env.tools:
            traj.malformed_calls += 1
            known = ", ".join(self.env.tools)
            return f"Error: {call.error or f'unknown tool {call.name!r}; available: {known}'}", []
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
            return f"Error: tool {call.name!r} timed out after {cfg.timeout_s:g} s", []
        except Exception as exc:  # noqa: BLE001 - the model is told, the run goes on
            traj.tool_errors += 1
            return f"Error: tool {call.name!r} failed: {type(exc).__name__}: {exc}", []
        traj.tool_reward += float(result.reward)
        if result.images and self.spec.images is None:
            traj.tool_errors += 1
            return f"Error: tool {call.name!r} returned images, which this model (text only) cannot see", []
        return result.text, list(result.images)

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
