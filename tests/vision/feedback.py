"""A test plugin (passed to ``load_plugins(extra=...)``): an interaction that answers every model turn
with a fixed reply, so that each conversation of a test run has several model turns; a tool that
returns an image, with a parser that reads a call to it in every model turn; an agent loop that
takes no images."""

from __future__ import annotations

from trellis import AgentLoop, Interaction, InteractionTurn, Tool, ToolCall, ToolCallParser, ToolResult, Trajectory, hookimpl
from trellis_demo.shapes import draw

REPLY = "Count again."


class CountAgain(Interaction):
    async def respond(self, instance_id, messages):
        return InteractionTurn(done=False, message=REPLY, score=0.0)


class Look(Tool):
    """Shows the model three squares (84 x 56 pixels: 6 image tokens)."""

    schema = {"type": "function", "function": {"name": "look", "description": "look again", "parameters": {"type": "object", "properties": {}}}}

    async def execute(self, instance_id, arguments):
        return ToolResult(text="Here it is.", images=[draw(((0, "red"), (2, "green"), (4, "blue")))])


class AlwaysLook(ToolCallParser):
    """Every model turn calls ``look`` (a random tiny model writes no tool call of its own)."""

    def parse(self, text):
        return [ToolCall("look", {})]


class OneTurn(AgentLoop):
    async def sample(self, prompt_ids, raw_prompt, extra_info, params):
        traj = Trajectory()
        traj.add_model(await self.engine.agenerate(prompt_ids, params))
        return traj


@hookimpl
def trellis_register(registry):
    registry.add("interaction", "count_again", CountAgain)
    registry.add("agent_loop", "one_turn", OneTurn)
    registry.add("tool", "look", Look)
    registry.add("tool_parser", "always_look", AlwaysLook)
