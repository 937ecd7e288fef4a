"""trellis-multiturn: the ``rl`` recipe's conversations (``multi_turn.enable=true``) through agent loops, interactions and tools.

``__all__`` is what an agent loop (kind ``agent_loop``) of another package needs beyond ``trellis``:
its spec and environment, chat deltas, sampled turns, user references."""

from trellis_multiturn.chat import ChatDeltas
from trellis_multiturn.environment import AgentSpec, Environment
from trellis_multiturn.references import finite_reward, load_reference
from trellis_multiturn.sampled import current_record, record_into

__all__ = [
    # what a loop is built with: the resolved multi_turn section (settings, tokenizer, template kwargs) and its environment
    "AgentSpec",
    "Environment",
    # environment turns token-exactly after sampled ones
    "ChatDeltas",
    # the sampled turns of the sample running in this task (checked against its trajectory), and where a server records them
    "current_record",
    "record_into",
    # a user's function named in the config (path/to/file.py:name), and a reward it returns
    "load_reference",
    "finite_reward",
]
