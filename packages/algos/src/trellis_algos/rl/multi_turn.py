"""The ``multi_turn`` config section (turn and token limits, interactions, tools, scoring) and what
the ``rl`` recipe asks of the package that runs it (trellis-multiturn)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from omegaconf import MISSING, DictConfig

from trellis import PromptEncoder, Registry, Scorer, choice, ranged, switch
from trellis.kit.recipe import RolloutFn
from trellis_algos.prompts import PromptDataset, PromptLoader

SCORES = ("last", "sum", "reward")


@dataclass
class InteractionConfig:
    """An interaction that samples pick by ``extra_info.interaction_kwargs.name`` (verl's schema).

    component: a registered interaction (kind ``interaction``); or
    verl_class: ``package.module.Class`` of an interaction written for verl (its
        ``BaseInteraction`` methods), run through an adapter without importing verl.
    options: the component's options (checked against its options dataclass), or the verl class's
        config dict.
    timeout_s: the longest one ``start`` / reply / ``finalize`` may take; past it the sample ends.
    """

    name: str = MISSING
    component: Optional[str] = None  # noqa: UP045 (omegaconf needs typing.Optional)
    verl_class: Optional[str] = None  # noqa: UP045
    options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = ranged(60.0, gt=0)


@dataclass
class ToolConfig:
    """A tool the model may call (hermes ``<tool_call>`` JSON by default).

    component / verl_class / options: as for interactions (a verl tool's class takes
        ``(config, tool_schema)``).
    schema: the OpenAI function schema (``{type: function, function: {name, description,
        parameters}}``); default: the component's own. Required for a verl class. Given alone
        (no component, no verl_class): a tool the agent runs itself (``openai_agent``, a verl
        loop of your own), rendered into the prompt and never run by trellis.
    max_concurrency: calls of this tool running at once over all samples (0: no limit).
    timeout_s: the longest one call may take; past it the model is told the call timed out.
    """

    component: Optional[str] = None  # noqa: UP045
    verl_class: Optional[str] = None  # noqa: UP045
    options: dict[str, Any] = field(default_factory=dict)
    schema: Optional[dict[str, Any]] = None  # noqa: UP045
    max_concurrency: int = ranged(0, ge=0)
    timeout_s: float = ranged(30.0, gt=0)


@dataclass
class AgentLoopConfig:
    """An agent loop that rows name in ``agent_name``: a registered one built with options (e.g.
    trellis-verl-compat's ``verl``, which runs a verl ``AgentLoopBase`` subclass).

    name: the name rows give in ``agent_name`` (not one of the installed agent loops).
    component: the registered agent loop (kind ``agent_loop``) that runs it.
    options: the component's options, checked against its options dataclass.
    """

    name: str = MISSING
    component: str = MISSING
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class MultiTurnConfig:
    """Rollouts as conversations: the model answers, then an interaction replies (or tools run)
    until the interaction ends it or a limit is reached.

    max_assistant_turns: model turns per sample. max_user_turns: interaction replies fed back.
    max_response_tokens: tokens after the prompt over all turns, model and environment (0:
        ``sampling.max_new_tokens`` x ``max_assistant_turns``); each model turn gets at most
        ``sampling.max_new_tokens`` of what is left.
    score: where a sample's reward comes from: ``last`` (the interaction's score of the last model
        turn) or ``sum`` (of every turn), plus tool rewards; or ``reward`` (the ``reward`` section's
        function on the whole trajectory).
    max_concurrent_samples: conversations in flight at once per engine.
    agent_loop: the registered agent loop (kind ``agent_loop``) of rows without an ``agent_name``
        column; a row's ``agent_name`` picks another one for its samples.
    agent_loops: agent loops built with options under names of their own, for rows to name in
        ``agent_name`` (verl's ``agent_loop_config_path`` entries).
    agent: the async function ``agent(client, sample) -> reward`` that the ``openai_agent`` loop
        runs per sample against the policy endpoint: ``path/to/file.py:function`` or
        ``package.module:function``.
    agent_timeout_s: the longest one sample's agent function may run; past it the sample ends
        (``finish_reason`` ``timeout``, reward 0).
    environment: an environment class, ``path/to/file.py:Class`` or ``package.module:Class``: its
        public typed methods are tools, one object per sample (``reset`` with the row's
        ``extra_info``), its optional ``reward()`` added to the sample's reward (docs/agents.md).
    environment_timeout_s: the longest its ``reset``, one method call or ``reward()`` may take.
    """

    enable: bool = switch(field(default=False), off=False, turn_on="to true to sample conversations")
    agent_loop: str = choice("tool_agent", kind="agent_loop")
    agent_loops: list[AgentLoopConfig] = field(default_factory=list)
    max_assistant_turns: int = ranged(2, ge=1)
    max_user_turns: int = ranged(1, ge=0)
    max_response_tokens: int = ranged(0, ge=0)
    interactions: list[InteractionConfig] = field(default_factory=list)
    tools: list[ToolConfig] = field(default_factory=list)
    tool_parser: str = choice("hermes", kind="tool_parser")
    max_tool_response_chars: int = ranged(1024, ge=1)
    score: str = choice("last", SCORES)
    max_concurrent_samples: int = ranged(64, ge=1)
    agent: str = ""
    agent_timeout_s: float = ranged(600.0, gt=0)
    environment: str = ""
    environment_timeout_s: float = ranged(30.0, gt=0)

    def response_budget(self, max_new_tokens: int) -> int:
        """Tokens after the prompt over all turns: ``max_response_tokens``, or (0) ``max_new_tokens`` a
        model turn times ``max_assistant_turns``."""
        return self.max_response_tokens or max_new_tokens * self.max_assistant_turns


class ConversationRollout(RolloutFn, Protocol):
    """The rollout function of a run's conversations, and how they are scored."""

    def scorer(self, reward_fn: Scorer, max_error_rate: float) -> Scorer:
        """The reward of whole conversations from ``reward_fn`` and the scores the environment gave
        (``multi_turn.score``); more than ``max_error_rate`` of a batch failing stops the run."""


class MultiTurnRunner(Protocol):
    """What runs the ``multi_turn`` section: kind ``rollout_function``, name ``multi_turn``
    (trellis-multiturn registers it). The recipe looks it up only with ``multi_turn.enable=true``."""

    def check(self, cfg: DictConfig, registry: Registry) -> None:
        """Errors in the section, its components and the rows of the data (``cfg``: the whole rl
        config), each naming the key and the fix, before any model is built."""

    def load(
        self, cfg: DictConfig, registry: Registry, tokenizer: Any, encoder: PromptEncoder | None
    ) -> tuple[ConversationRollout, PromptLoader, PromptDataset | None]:
        """The run's conversations (the agent loops the rows pick), its training prompt loader and
        held-out prompts, read with the chat template's keyword arguments the section sets."""
