"""trellis-multiturn's entry point: the ``multi_turn`` runner, the ``tool_agent`` loop and the ``hermes`` tool-call parser."""

from trellis import hookimpl
from trellis_multiturn.loop import ToolAgentLoop
from trellis_multiturn.runner import MultiTurn
from trellis_multiturn.tool_calls import HermesParser


@hookimpl
def trellis_register(registry):
    registry.add("rollout_function", "multi_turn", MultiTurn())
    registry.add("agent_loop", "tool_agent", ToolAgentLoop)
    registry.add("tool_parser", "hermes", HermesParser)
