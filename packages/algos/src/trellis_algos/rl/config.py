"""The ``rl`` recipe's config sections (``trellis config init`` lists them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trellis import PromptData, RecipeConfig, SamplingConfig, TrainerConfig, choice, component, ranged
from trellis_algos.rewards import RewardConfig
from trellis_algos.rl.ahead import MODES, SCHEDULES
from trellis_algos.rl.dynamic_sampling import DynamicSamplingConfig
from trellis_algos.rl.multi_turn import MultiTurnConfig
from trellis_algos.rl.sync_probe import SyncCheckConfig
from trellis_algos.rl.teacher import TeacherConfig
from trellis_algos.sections import ActorConfig, CriticConfig


@dataclass
class ValidationConfig:
    """Held-out evaluation: greedy reward and reward of ``n`` samples at ``temperature``."""

    before_train: bool = True
    n: int = ranged(1, ge=1)
    temperature: float = ranged(1.0, ge=0)


@dataclass
class AlgorithmConfig:
    """advantage: a registered estimator. KL in the reward (verl's ``use_kl_in_reward``): token
    rewards minus ``kl_coef`` x KL(actor || ref), with a fixed or adaptive coefficient.
    dynamic_sampling: drop prompt groups whose rewards are all equal and refill the batch
    (``trellis.recipes.dynamic_sampling``)."""

    advantage: dict = component("advantage", "grpo")
    use_kl_in_reward: bool = False
    kl_penalty: str = choice("k1", kind="kl")
    kl_ctrl_type: str = choice("fixed", ("fixed", "adaptive"))
    kl_coef: float = ranged(0.001, ge=0)
    target_kl: float = ranged(0.1, gt=0)
    kl_horizon: int = ranged(10000, ge=1)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)


@dataclass
class RLTrainerConfig(TrainerConfig):
    """async_mode: ``off`` (generate, then train), ``one_step`` (generate step k+1 while training
    step k) or ``fully_async`` (up to ``max_staleness`` steps ahead, default 1); see
    ``trellis_algos.rl.ahead``. Generation ahead needs an engine with weights of its own.
    async_schedule: ``exact`` (step t generates from exactly the weights of step t-1-max_staleness,
    whatever the timing; runs with one seed, and resumed runs, are bit-identical: docs/async.md) or
    ``opportunistic`` (from whatever weights were last synced when its generation starts, at most
    that old: never waits for generation)."""

    async_mode: str = choice("off", MODES)
    max_staleness: int | None = ranged(None, ge=0)
    async_schedule: str = choice("exact", SCHEDULES)
    # fully_async: a weight sync goes in between chunks of this many tokens of a generation running
    # ahead, which then continues under the new weights (trellis_algos.rl.partial; default 32)
    partial_rollout: bool = False
    rollout_chunk_tokens: int | None = ranged(None, ge=1)


@dataclass
class RLConfig(RecipeConfig):
    recipe: str = "rl"
    data: PromptData = field(default_factory=PromptData)
    rollout: dict = component("rollout", "hf")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    sync_check: SyncCheckConfig = field(default_factory=SyncCheckConfig)
    trainer: RLTrainerConfig = field(default_factory=RLTrainerConfig)
