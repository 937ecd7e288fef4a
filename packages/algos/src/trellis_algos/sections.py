"""The config sections of the roles trellis-algos' recipes train (the actor and critic of ``rl``, the
policy of ``sft`` and ``spin``), and the check each recipe makes of the files its config names."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from trellis import AGG_MODES, AdapterConfig, BatchingConfig, ConfigError, OptimConfig, choice, component, ranged, switch
from trellis.kit.recipe import REPLAY_MODES
from trellis.kit.rewards import check_not_a_run


def data_files(value: Any) -> list[str]:
    """The files a ``train_path``/``val_path`` value names: one path, a list of them, or none."""
    if value is None:
        return []
    return [str(value)] if isinstance(value, str) else [str(p) for p in value]


def check_inputs(cfg: DictConfig) -> None:
    """The model folder and the data files a recipe names must exist (checked before building)."""
    for key in ("train_path", "val_path"):
        paths = data_files(cfg.data.get(key))
        if paths == [] and cfg.data.get(key) is not None:
            raise ConfigError(f"config key 'data.{key}' is an empty list; give a parquet or jsonl file, or a list of them")
        for path in paths:
            if not Path(path).is_file():
                raise ConfigError(f"config key 'data.{key}': file {path!r} does not exist; give the path of a parquet or jsonl file")
    if not Path(cfg.model.path).exists():
        raise ConfigError(f"config key 'model.path': {cfg.model.path!r} does not exist; give a Hugging Face model folder")
    check_not_a_run(Path(cfg.model.path))


@dataclass
class DistillConfig:
    """A distillation term in the actor's loss: ``coef`` x a registered divergence (kind
    ``distill_loss``: ``reverse_kl``, ``forward_kl``, ``jsd``) between the student's and the
    teacher's (``teacher.path``) next-token distributions at every response position, aggregated
    with ``loss_agg_mode``. top_k: the teacher's ``top_k`` most likely tokens per position are
    shipped and compared, the rest of each distribution lumped in one bucket (0: the whole
    vocabulary, exact). use_policy_loss false: the actor's loss is this term alone (no policy
    gradient from the advantages), as verl's ``distillation.use_policy_loss``."""

    coef: float = switch(ranged(0.0, ge=0), off=0.0, turn_on="above 0 (e.g. 1.0) to add the teacher's divergence to the actor's loss")
    loss: dict = component("distill_loss", "reverse_kl")
    top_k: int = ranged(0, ge=0)
    use_policy_loss: bool = True


@dataclass
class ActorConfig(BatchingConfig):
    """The policy's update: a registered policy loss, optional KL loss and entropy bonus."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    policy_loss: dict = component("policy_loss", "vanilla")
    loss_agg_mode: str = choice("token-mean", AGG_MODES)
    loss_norm_constant: float | None = ranged(None, gt=0)  # seq-mean-token-sum-norm divisor; None = the mini-batch's padded response length
    use_kl_loss: bool = False
    kl_loss_coef: float = ranged(0.001, ge=0)
    kl_loss_type: str = choice("low_var_kl", kind="kl")
    entropy_coeff: float = ranged(0.0, ge=0)
    mask_truncated: bool = False  # rl: samples cut by sampling.max_new_tokens leave the actor's loss (DAPO's overlong filtering)
    # rl, a mixture-of-experts model: the engine records each token's experts; ``measure`` counts where the trainer's
    # routing differs (moe/routing_flip_rate), ``rollout`` replays them in every forward of the policy (R3; docs/moe.md)
    router_replay: str = choice("off", REPLAY_MODES)
    router_aux_loss_coef: float = ranged(0.0, ge=0)  # a mixture-of-experts model's load-balancing loss in the actor's loss
    adapter: AdapterConfig = field(default_factory=AdapterConfig)  # rank > 0: train a LoRA adapter, not the full weights
    distill: DistillConfig = field(default_factory=DistillConfig)  # coef > 0: a teacher's divergence in the loss (rl)


@dataclass
class CriticConfig(BatchingConfig):
    """The value model's update: clipped value loss (PPO's critic)."""

    model_path: str | None = None  # None: start from the actor's model
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    cliprange_value: float = ranged(0.5, gt=0)
    loss_agg_mode: str = choice("token-mean", AGG_MODES)
    loss_norm_constant: float | None = ranged(None, gt=0)  # seq-mean-token-sum-norm divisor; None = the mini-batch's padded response length


@dataclass
class SFTTrainConfig:
    """Supervised fine-tuning update: a registered SFT loss over ``loss_mask`` tokens."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    micro_batch_samples: int = ranged(8, ge=1)
    max_tokens_per_micro_batch: int = ranged(0, ge=0)
    loss: dict = component("sft_loss", "cross_entropy")
    loss_agg_mode: str = choice("token-mean", AGG_MODES)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)


@dataclass
class PreferenceTrainConfig:
    """Preference (DPO-family) updates of a policy on chosen/rejected pairs: a registered
    preference loss, batching in pairs."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    micro_batch_samples: int = ranged(8, ge=1)
    loss: dict = component("preference_loss", "sigmoid")
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
