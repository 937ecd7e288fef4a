"""A test plugin (passed to ``load_plugins(extra=...)``): an interaction that answers every model turn
with a fixed reply, so that each conversation of a test run has several model turns, and an agent
loop that takes no images."""

from __future__ import annotations

from trellis import AgentLoop, Interaction, InteractionTurn, Trajectory, hookimpl

REPLY = "Count again."


class CountAgain(Interaction):
    async def respond(self, instance_id, messages):
        return InteractionTurn(done=False, message=REPLY, score=0.0)


class OneTurn(AgentLoop):
    async def sample(self, prompt_ids, raw_prompt, extra_info, params):
        traj = Trajectory()
        traj.add_model(await self.engine.agenerate(prompt_ids, params))
        return traj


@hookimpl
def trellis_register(registry):
    registry.add("interaction", "count_again", CountAgain)
    registry.add("agent_loop", "one_turn", OneTurn)
