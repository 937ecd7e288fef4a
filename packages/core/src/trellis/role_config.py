"""Options of the trainable roles, shared by every backend: optimizer, batching, losses."""

from __future__ import annotations

from dataclasses import dataclass, field

from trellis.config import component

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class OptimConfig:
    """AdamW with warm-up then a constant or cosine schedule; the scheduler steps once per
    trainer step (as verl does), so ``warmup_steps`` counts trainer steps."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass
class BatchingConfig:
    """How one step's samples are cut for a role's update.

    mini_batch_samples: samples per optimizer step (0: the whole step's batch in one step).
    micro_batch_samples: samples per forward/backward (gradient accumulation within a mini-batch).
    max_tokens_per_micro_batch: if > 0, micro-batches are cut by this padded-token budget
        instead (dynamic batching); ``micro_batch_samples`` is then ignored.
    """

    ppo_epochs: int = 1
    mini_batch_samples: int = 0
    micro_batch_samples: int = 8
    max_tokens_per_micro_batch: int = 0
    shuffle: bool = False


@dataclass
class ActorConfig(BatchingConfig):
    """The policy's update: a registered policy loss, optional KL loss and entropy bonus."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    policy_loss: dict = component("policy_loss", "vanilla")
    loss_agg_mode: str = "token-mean"
    loss_norm_constant: float | None = None  # seq-mean-token-sum-norm divisor; None = response length
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0


@dataclass
class CriticConfig(BatchingConfig):
    """The value model's update: clipped value loss (PPO's critic)."""

    model_path: str | None = None  # None: start from the actor's model
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


@dataclass
class SFTTrainConfig:
    """Supervised fine-tuning update: a registered SFT loss over ``loss_mask`` tokens."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    micro_batch_samples: int = 8
    max_tokens_per_micro_batch: int = 0
    loss: dict = component("sft_loss", "cross_entropy")
    loss_agg_mode: str = "token-mean"
