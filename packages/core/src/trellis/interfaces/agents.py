"""Base classes for multi-turn rollouts: interactions (kind ``interaction``), tools (``tool``) and
agent loops (``agent_loop``), with the ``Trajectory`` a loop returns.

Interactions and tools follow verl's shape so verl users recognise them; every method is async so
the agent loop runs many samples at once. A loop always calls ``finalize``/``release`` in ``finally``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from trellis.interfaces.backend import join_images

if TYPE_CHECKING:
    from trellis.interfaces.rollout import Generation, RolloutEngine, SamplingParams


@dataclass
class ToolCall:
    """One call the model asked for; ``error`` says why it cannot run (then ``name`` may be "")."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class ToolCallParser:
    """``parse(text) -> list[ToolCall]``; an empty list means the turn called no tool."""

    def parse(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """The text outside the calls and the calls that can run (the policy endpoint answers them
        as ``content`` and ``tool_calls``); by default the whole text and every call without an error."""
        return text, [c for c in self.parse(text) if c.error is None]


@dataclass
class InteractionTurn:
    """The environment's answer to a model turn."""

    done: bool
    message: str  # the user-turn text fed back to the model ("" when done)
    score: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


class Interaction:
    """An environment that replies to the model turn by turn (e.g. checks an answer, gives a hint)."""

    def __init__(self, options: Any = None) -> None:
        self.options = options

    async def start(self, instance_id: str, **kwargs: Any) -> None:
        """Begin an episode; ``kwargs`` come from the sample's ``extra_info.interaction_kwargs``."""

    async def respond(self, instance_id: str, messages: list[dict[str, str]]) -> InteractionTurn:
        """Reply to the conversation so far (chat messages, the model's last turn at the end)."""
        raise NotImplementedError

    async def finalize(self, instance_id: str) -> None:
        """Release the episode's state; always called."""


@dataclass
class ToolResult:
    """What a tool call returns to the model: ``text``, and ``images`` (bytes, paths or PIL images,
    as verl's tool responses give them) for a vision-language model, shown before the text."""

    text: str
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)


class Tool:
    """A function the model may call; ``schema`` is the OpenAI function-calling schema."""

    schema: dict[str, Any] = {}

    def __init__(self, options: Any = None) -> None:
        self.options = options

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        """Prepare per-sample state (e.g. the ground truth to check against)."""

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        raise NotImplementedError

    async def release(self, instance_id: str) -> None:
        """Release per-sample state; always called."""


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
    agent_reward: float = 0.0  # the loop's own reward for the whole sample (an ``openai_agent``'s return value, an environment class's reward())
    # agent_reward is the sample's whole reward, as verl takes an agent loop's reward_score: under
    # multi_turn.score=reward the reward function scores only the samples their loop did not
    agent_scored: bool = False
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    malformed_calls: int = 0
    finish: str = ""
    error: str = ""
    # the images environment turns showed the model, processed (``IMAGE_INPUTS``' dict), in the order of their slots
    image_inputs: dict[str, Any] = field(default_factory=dict)
    # a mixture-of-experts model's experts per token of prompt + response ``(tokens, layers, top_k)``, -1 where no turn
    # recorded them (``trellis.interfaces.moe.conversation_routes``); set by the multi-turn rollout, not by loops
    routed_experts: Any = None

    def add_model(self, gen: Generation) -> None:
        self.response_ids += gen.token_ids
        self.response_mask += [1] * len(gen.token_ids)
        self.log_probs += gen.log_probs
        self.assistant_turns += 1

    def add_environment(self, ids: list[int], images: dict[str, Any] | None = None) -> None:
        """An environment turn's token ids (mask 0) and the processed images whose slots they hold."""
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        if images:
            self.image_inputs = join_images(self.image_inputs, images)
        self.log_probs += [0.0] * len(ids)


class AgentLoop:
    """How one sample's turns go (kind ``agent_loop``): which side speaks when, what ends it.

    A row of the data picks its loop by name in its ``agent_name`` column (verl's), else
    ``multi_turn.agent_loop``. Built as ``cls(engine, spec, env)`` once per rollout call beside each
    engine (``cls(engine, spec, env, options)`` for an entry of ``multi_turn.agent_loops``: a loop
    registered with an options dataclass gets its checked options there): ``engine`` to await
    ``agenerate`` on; ``spec`` the resolved ``multi_turn`` section
    (trellis-multiturn's ``AgentSpec``: ``settings``, ``tokenizer``,
    ``template_kwargs``); ``env`` its interactions, tools and tool-call parser built in this process
    (``Environment``), shared by every loop of the call. Many ``sample`` calls run at once on one
    loop object. trellis-multiturn's ``tool_agent`` is the default;
    ``trellis_multiturn.ChatDeltas`` renders environment turns token-exactly.

    ``runs_tools``: the loop runs the model's tool calls itself from ``env.tools``, so it cannot
    serve a ``multi_turn.tools`` entry that gives only a schema (a tool the agent runs; refused
    before any model is built). ``row_fields``: ``sample`` takes a keyword ``fields`` with the
    row's other columns (the engines are then shipped every column of the prompts). ``runs_agent``:
    the loop runs the user's function ``multi_turn.agent`` (set exactly when such a loop is used).
    ``brings_environment``: the loop holds its own environment, so it runs with none of the
    section's (no interaction, tool, environment class or agent function configured).
    ``takes_images``: ``sample`` takes a keyword ``images``, the prompt's image inputs (a
    vision-language model's), and hands them to every ``agenerate`` of the sample; a run with image
    prompts refuses the loops that do not.
    :meth:`check` refuses the ``multi_turn`` settings a loop cannot run with.
    """

    runs_tools = False
    takes_images = False
    # True: ``sample`` also gets ``fields``, the row's other columns (``data_source``,
    # ``reward_model``, ...), as verl hands its loops every column of the row
    row_fields = False
    runs_agent = False
    brings_environment = False

    @classmethod
    def check(cls, settings: Any) -> None:
        """Refuse ``multi_turn`` ``settings`` (a ``MultiTurnConfig``) this loop cannot run with,
        naming the key and the fix; called before any model is built for each loop the run uses."""

    def __init__(self, engine: RolloutEngine, spec: Any, env: Any) -> None:
        self.engine = engine
        self.spec = spec
        self.env = env
        self.settings = spec.settings
        self.tokenizer = spec.tokenizer

    async def sample(self, prompt_ids: list[int], raw_prompt: list[dict], extra_info: dict, params: SamplingParams) -> Trajectory:
        """One conversation after ``prompt_ids`` (the rendered ``raw_prompt`` chat messages, ending
        in the generation prompt); ``extra_info`` is the row's (``{}`` when it has none), ``params``
        one sample's (``n`` 1, its own seed). Every token the model did not sample is the
        environment's (``Trajectory.add_environment``: mask 0)."""
        raise NotImplementedError

    async def close(self) -> None:
        """Called once after every sample of the rollout call ended (e.g. to stop a server the loop started)."""


class ClassAdapter(Protocol):
    """Runs interactions and tools written for another framework unchanged (kind ``class_adapter``):
    trellis-verl-compat's ``verl`` runs verl's ``BaseInteraction`` / ``BaseTool`` subclasses, which a
    ``multi_turn`` entry names by ``verl_class``. Each method raises ``ValueError`` naming ``key``
    (the entry's config key) and the fix when the class cannot be used."""

    def interaction(self, path: str, options: dict[str, Any], name: str, key: str) -> Callable[[], Interaction]:
        """A factory of the interaction the class ``path`` (``package.module.Class``) is, built with ``options``."""

    def tool(self, path: str, options: dict[str, Any], schema: dict[str, Any], key: str) -> Callable[[], Tool]:
        """A factory of the tool the class ``path`` is, built with ``options`` and its OpenAI function ``schema``."""

    def start_needs(self, path: str) -> tuple[str, ...]:
        """The keys of ``extra_info.interaction_kwargs`` the interaction class ``path`` cannot start without."""
