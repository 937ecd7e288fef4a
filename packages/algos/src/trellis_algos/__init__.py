"""Trellis algorithms and recipes: advantage estimators, policy/KL/SFT/preference losses, loss aggregation,
and the ``rl``, ``sft``, ``spin`` and ``rm`` recipes.

The names below are what other packages may import from trellis-algos (the ``rl`` recipe's
``multi_turn`` section for agent loops and rollout functions, its ``reward`` section, reward manager
and reward services, the tokenizer checks for roles that score the actor's ids); every module may change. They load on first use."""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("trellis-algos")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

# public name -> module that defines it
_API = {
    # the rl recipe's multi_turn section and the protocols it calls (kind rollout_function: trellis-multiturn's)
    "MultiTurnConfig": "trellis_algos.rl.multi_turn",
    "MultiTurnRunner": "trellis_algos.rl.multi_turn",
    "ConversationRollout": "trellis_algos.rl.multi_turn",
    "InteractionConfig": "trellis_algos.rl.multi_turn",
    "ToolConfig": "trellis_algos.rl.multi_turn",
    "AgentLoopConfig": "trellis_algos.rl.multi_turn",
    # the reward section of the rl and spin recipes, the manager that scores a batch with it, the rule rewards
    "RewardConfig": "trellis_algos.rewards",
    "RewardTerm": "trellis_algos.rewards",
    "RewardManager": "trellis_algos.rewards",
    "reward_name": "trellis_algos.rewards",
    "resolve_reward": "trellis_algos.rewards",
    "check_reward": "trellis_algos.rewards",
    "gsm8k_score": "trellis_algos.rewards",
    "math_score": "trellis_algos.rewards",
    # a service the rl recipe starts for its reward (kind reward_service), what it is started with, the metric keys it must not take
    "RewardService": "trellis_algos.rewards",
    "ServiceContext": "trellis_algos.rewards",
    "RESERVED_KEYS": "trellis_algos.rewards",
    # a folder's tokenizer (a ConfigError naming the key when it holds none), and what differs between two
    "load_tokenizer": "trellis_algos.rl.teacher",
    "tokenizer_difference": "trellis_algos.rl.teacher",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        return getattr(import_module(_API[name]), name)
    raise AttributeError(f"module 'trellis_algos' has no attribute {name!r}")
