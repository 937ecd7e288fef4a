"""The agent loop ``openai_agent``: a user's async function ``agent(client, sample) -> reward``
(``multi_turn.agent``) runs each sample against the policy endpoint with an ``openai`` client, and
the sample trains on exactly the tokens the endpoint sampled for it, scored with the returned reward."""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import openai

from trellis import AgentLoop, ConfigError, RolloutEngine, SamplingParams, Trajectory
from trellis_agents.endpoint import HEADER, PolicyEndpoint
from trellis_algos import MultiTurnConfig
from trellis_multiturn import AgentSpec, Environment, current_record, finite_reward, load_reference

log = logging.getLogger("trellis")

KEY = "multi_turn.agent"


@dataclass
class AgentSample:
    """What an agent function gets besides its client: the row's prompt as chat messages (a chat
    request must begin with them), as the text and token ids the chat template renders them to
    (a completions request's prompt must begin with either), the tool schemas it was rendered with
    (a request's ``tools``, if given, must be these) and the row's ``extra_info``."""

    messages: list[dict[str, Any]]
    prompt_text: str
    prompt_ids: list[int]
    tools: list[dict[str, Any]]
    extra_info: dict[str, Any]


class Agent(Protocol):
    """``multi_turn.agent``: runs one episode with ``client`` (an ``openai.AsyncOpenAI`` pointed at
    the policy endpoint, bound to this sample's trajectory) and returns its reward."""

    async def __call__(self, client: Any, sample: AgentSample) -> float: ...


def load_agent(ref: str) -> Callable[..., Any]:
    """The async function ``path/to/file.py:function`` or ``package.module:function`` names."""
    fn = load_reference(ref, KEY)
    if not inspect.iscoroutinefunction(fn):
        name = ref.rpartition(":")[2]
        raise ConfigError(f"config key '{KEY}': {ref!r} is not an async function; define it as `async def {name}(client, sample) -> float`")
    return fn


class OpenAIAgentLoop(AgentLoop):
    """Each sample is one call of ``multi_turn.agent`` with its own ``openai`` client (registered
    as ``openai_agent``). The policy endpoint starts with the first sample and stops when the
    rollout call ends (:meth:`close`); samples run concurrently up to ``max_concurrent_samples``,
    each for at most ``agent_timeout_s``.

    The trajectory is what the endpoint recorded (``trellis_agents.endpoint``): each call that
    continues the conversation adds its new messages' tokens (mask 0) and the sampled tokens.
    The returned number is the sample's reward; an agent that raises or times out gives 0
    (``finish_reason`` ``error`` / ``timeout``, the first error logged), unless the trajectory
    had already stopped growing (a limit, or rewritten history: that reason is kept).
    """

    runs_agent = True

    @classmethod
    def check(cls, settings: MultiTurnConfig) -> None:
        """The agent's return value is the reward (``multi_turn.score`` is not ``reward``) and its function loads."""
        if settings.score == "reward":
            raise ConfigError(
                f"config key 'multi_turn.score' is reward with {KEY}: the reward function would score the decoded trajectories and "
                "ignore what the agent returns; set multi_turn.score=last (the agent's reward, plus any interaction's)"
            )
        load_agent(settings.agent)

    def __init__(self, engine: RolloutEngine, spec: AgentSpec, env: Environment) -> None:
        super().__init__(engine, spec, env)
        self.agent = load_agent(self.settings.agent)
        self.endpoint: Any = None
        self._client: Any = None  # the openai client every sample's is a copy of
        self._pool: Any = None  # their connection pool
        self._starting = asyncio.Lock()
        self._logged_error = False

    async def sample(self, prompt_ids: list[int], raw_prompt: list[dict], extra_info: dict, params: SamplingParams) -> Trajectory:
        endpoint = await self._endpoint()
        s = self.settings
        budget = s.response_budget(params.max_new_tokens)
        record = current_record()
        episode = endpoint.open(prompt_ids, raw_prompt, params, budget, s.max_assistant_turns, [] if record is None else record)
        client = self._client.with_options(default_headers={HEADER: episode.id})
        outcome, reward = "done", 0.0
        try:
            tools = copy.deepcopy(list(self.spec.template_kwargs.get("tools") or []))
            sample = AgentSample(copy.deepcopy(list(raw_prompt)), episode.chain_text, list(prompt_ids), tools, copy.deepcopy(dict(extra_info)))
            reward = finite_reward(await asyncio.wait_for(self.agent(client, sample), s.agent_timeout_s), "the agent")
        except asyncio.TimeoutError:
            outcome = "timeout"
        except Exception as exc:  # noqa: BLE001 - the user's agent failed: this sample ends, the run goes on
            outcome = "error"
            episode.trajectory.error = f"{type(exc).__name__}: {exc}"
            self._log_error(exc)
        finally:
            await endpoint.end(episode)
        if episode.engine_error is not None:
            raise episode.engine_error
        traj = episode.trajectory
        traj.finish = episode.ended or outcome
        traj.agent_reward = reward
        return traj

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close_pool()
            self._client = self._pool = None
        if self.endpoint is not None:
            await self.endpoint.close()
            self.endpoint = None

    async def _endpoint(self) -> Any:
        async with self._starting:
            if self.endpoint is None:
                endpoint = PolicyEndpoint(self.engine, self.tokenizer, self.spec.template_kwargs, self.env.parser)
                await endpoint.start()
                self.endpoint = endpoint
                # one connection pool for all samples: building a client per sample (its TLS context) costs ~30 ms
                self._pool = _shared_pool()
                self._client = openai.AsyncOpenAI(
                    base_url=endpoint.url, api_key=endpoint.token, max_retries=0, timeout=self.settings.agent_timeout_s, http_client=self._pool
                )
        return self.endpoint

    def _log_error(self, exc: Exception) -> None:
        if not self._logged_error:
            self._logged_error = True
            log.error(
                "openai_agent: %s raised; that sample ends with reward 0 (finish_reason error; later failures are counted, not logged)\n%s",
                self.settings.agent,
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            )


def _shared_pool() -> Any:
    """The connection pool of every sample's client; an agent that closes its client (``async
    with``) leaves it open for the others, the loop closes it (``close_pool``)."""

    class SharedPool(openai.DefaultAsyncHttpxClient):
        async def aclose(self) -> None:
            pass

        async def close_pool(self) -> None:
            await super().aclose()

    return SharedPool()
