"""Base classes for multi-turn environments: interactions (kind ``interaction``) and tools (``tool``).

Both follow verl's shape so verl users recognise them; every method is async so the agent loop
runs many samples at once. The loop always calls ``finalize``/``release`` in ``finally``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    text: str
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


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
