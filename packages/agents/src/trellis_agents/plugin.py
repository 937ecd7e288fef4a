"""The ``openai_agent`` loop, registered by entry point (``multi_turn.agent_loop=openai_agent``)."""

from __future__ import annotations

import trellis


@trellis.hookimpl
def trellis_register(registry):
    from trellis_agents.loop import OpenAIAgentLoop

    registry.add("agent_loop", "openai_agent", OpenAIAgentLoop)
