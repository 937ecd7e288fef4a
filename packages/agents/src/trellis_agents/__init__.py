"""Trellis agents: an agent written against the ``openai`` client trains through a policy endpoint
(agent loop ``openai_agent``). ``Agent`` and ``AgentSample`` are what an agent function is given."""

from trellis_agents.loop import Agent, AgentSample

__all__ = ["Agent", "AgentSample"]
