"""Trellis algorithms and recipes: advantage estimators, policy/KL/SFT/preference losses, loss aggregation,
and the ``rl``, ``sft``, ``spin`` and ``rm`` recipes.

``__all__`` is what other packages may import from trellis-algos: the recipes' data (prompts in verl's
schema, resumable loaders), the config sections of the roles its recipes train, the ``rl`` recipe's
``multi_turn`` section for agent loops and rollout functions, its ``reward`` section, reward manager
and reward services, the tokenizer checks for roles that score the actor's ids, and the OpenAI wire
format that the policy endpoint (trellis-agents) and the judge server (trellis-judges) speak (the
module ``openai_api``). Every other module may change."""

from importlib.metadata import PackageNotFoundError, version

# the OpenAI wire format: /v1/chat/completions and /v1/completions requests checked field by field, and the replies
from trellis_algos import openai_api

# prompts in verl's schema for the recipes that generate, tokenized and served by a resumable loader; the rows as read
# (for checks), a vision-language model's prompt encoder; the resumable epochs every recipe's loader has
from trellis_algos.loaders import EpochLoader
from trellis_algos.prompts import PROMPT_COLUMNS, PromptDataset, PromptLoader, load_prompt_data, load_prompt_rows, prompt_images

# the reward section of the rl and spin recipes, the manager that scores a batch with it, the rule rewards; a service the
# rl recipe starts for its reward (kind reward_service), what it is started with, the metric keys it must not take
from trellis_algos.rewards import (
    RESERVED_KEYS,
    RewardConfig,
    RewardManager,
    RewardService,
    RewardTerm,
    ServiceContext,
    check_reward,
    gsm8k_score,
    math_score,
    resolve_reward,
    reward_name,
)

# the rl recipe's multi_turn section and the protocols it calls (kind rollout_function: trellis-multiturn's)
from trellis_algos.rl.multi_turn import AgentLoopConfig, ConversationRollout, InteractionConfig, MultiTurnConfig, MultiTurnRunner, ToolConfig

# the sections of the roles the recipes train (rl's actor and critic, sft's and spin's policy); the check of the files a
# recipe's config names
from trellis_algos.sections import ActorConfig, CriticConfig, DistillConfig, PreferenceTrainConfig, SFTTrainConfig, check_inputs

# the folder of the policy's tokenizer and its config keys; a folder's tokenizer (a ConfigError naming the key when it
# holds none), and what differs between two
from trellis_algos.tokenizers import POLICY_TOKENIZER_KEY, load_tokenizer, policy_tokenizer_path, tokenizer_difference

try:
    __version__ = version("trellis-algos")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = [
    "__version__",
    "openai_api",
    "PROMPT_COLUMNS",
    "PromptDataset",
    "PromptLoader",
    "EpochLoader",
    "load_prompt_data",
    "load_prompt_rows",
    "prompt_images",
    "ActorConfig",
    "CriticConfig",
    "DistillConfig",
    "SFTTrainConfig",
    "PreferenceTrainConfig",
    "check_inputs",
    "MultiTurnConfig",
    "MultiTurnRunner",
    "ConversationRollout",
    "InteractionConfig",
    "ToolConfig",
    "AgentLoopConfig",
    "POLICY_TOKENIZER_KEY",
    "policy_tokenizer_path",
    "load_tokenizer",
    "tokenizer_difference",
    "RewardConfig",
    "RewardTerm",
    "RewardManager",
    "reward_name",
    "resolve_reward",
    "check_reward",
    "gsm8k_score",
    "math_score",
    "RewardService",
    "ServiceContext",
    "RESERVED_KEYS",
]
