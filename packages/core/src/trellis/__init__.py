"""Trellis: reinforcement-learning post-training for language models, as a core plus plugins.

``__all__`` is the public API that plugins and recipes may use, with the kits for backend and
rollout-engine authors (``trellis.kit.backend``, ``trellis.kit.engine``); every other module may
change. Names load on first use, so ``import trellis`` stays light.
"""

from importlib import import_module
from importlib.metadata import version

__version__ = version("trellis-core")

# public name -> module that defines it
_API = {
    # plugins and the registry
    "hookimpl": "trellis.hookspecs",
    "KINDS": "trellis.registry",
    "Registry": "trellis.registry",
    "RegistryError": "trellis.registry",
    "load_plugins": "trellis.plugins",
    # config
    "choice": "trellis.config",
    "component": "trellis.config",
    "ranged": "trellis.config",
    "switch": "trellis.config",
    "ConfigError": "trellis.config",
    "instantiate_options": "trellis.config",
    "checked_options": "trellis.config",
    "validate": "trellis.config",
    "resolve_component": "trellis.config",
    "compose": "trellis.config",
    "validate_recipe_config": "trellis.config",
    # data and rewards
    "Batch": "trellis.batch",
    "position_ids": "trellis.batch",
    "last_valid_index": "trellis.batch",
    "DataError": "trellis.data",
    "chat_messages": "trellis.data",
    "require_pad_id": "trellis.data",
    "load_rows": "trellis.data",
    "VERL_SCHEMA": "trellis.data",
    "row_value": "trellis.data",
    "stream_seed": "trellis.rng",
    "encode_response": "trellis.data",
    "PromptEncoder": "trellis.data",
    "render_chat": "trellis.data",
    "encode_text": "trellis.data",
    "RewardResult": "trellis.rewards",
    "Scorer": "trellis.rewards",
    "RewardError": "trellis.rewards",
    "load_function": "trellis.rewards",
    # interfaces: backends, dispatch, rollout, algorithms, environments
    "Backend": "trellis.interfaces.backend",
    "BackendSpec": "trellis.interfaces.backend",
    "DistInfo": "trellis.interfaces.backend",
    "IMAGE_INPUTS": "trellis.interfaces.backend",
    "Mesh": "trellis.interfaces.dispatch",
    "Route": "trellis.interfaces.dispatch",
    "DispatchMode": "trellis.interfaces.dispatch",
    "ALL": "trellis.interfaces.dispatch",
    "RANK0": "trellis.interfaces.dispatch",
    "DP_SPLIT": "trellis.interfaces.dispatch",
    "RolloutEngine": "trellis.interfaces.rollout",
    "RolloutSpec": "trellis.interfaces.rollout",
    "SamplingParams": "trellis.interfaces.rollout",
    "Generation": "trellis.interfaces.rollout",
    "rollout_batch": "trellis.interfaces.rollout",
    "AdvantageInputs": "trellis.interfaces.signatures",
    "AGG_MODES": "trellis.interfaces.signatures",
    "Aggregation": "trellis.interfaces.signatures",
    "aggregation_for": "trellis.interfaces.signatures",
    "PolicyLossInputs": "trellis.interfaces.signatures",
    "PreferenceInputs": "trellis.interfaces.signatures",
    "Objective": "trellis.interfaces.signatures",
    "pair_batch": "trellis.interfaces.signatures",
    "PAIR_FIELDS": "trellis.interfaces.signatures",
    "SCORED_PAIR_FIELDS": "trellis.interfaces.signatures",
    "Interaction": "trellis.interfaces.agents",
    "InteractionTurn": "trellis.interfaces.agents",
    "Tool": "trellis.interfaces.agents",
    "ToolResult": "trellis.interfaces.agents",
    "ToolCall": "trellis.interfaces.agents",
    "ToolCallParser": "trellis.interfaces.agents",
    "AgentLoop": "trellis.interfaces.agents",
    "Trajectory": "trellis.interfaces.agents",
    # runtime: the harness recipes compose, controllers, trackers
    "Run": "trellis.runtime.harness",
    "RunContext": "trellis.runtime.harness",
    "WorkerGroup": "trellis.runtime.controller",
    "RolloutGroup": "trellis.runtime.controller",
    "SyncCheckFailed": "trellis.interfaces.transport",
    "Tracker": "trellis.runtime.trackers",
    # recipes
    "Recipe": "trellis.recipes.train",
    "train": "trellis.recipes.train",
    "ModelConfig": "trellis.recipes.options",
    "RecipeConfig": "trellis.recipes.options",
    "TrainerConfig": "trellis.recipes.options",
    "OptimConfig": "trellis.recipes.options",
    "AdapterConfig": "trellis.recipes.options",
    "BatchingConfig": "trellis.recipes.options",
    "PromptData": "trellis.recipes.options",
    "SamplingConfig": "trellis.recipes.options",
    "backend_field": "trellis.recipes.options",
    "without_adapter": "trellis.recipes.options",
    "save_hf_folder": "trellis.export",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        return getattr(import_module(_API[name]), name)
    raise AttributeError(f"module 'trellis' has no attribute {name!r}")
