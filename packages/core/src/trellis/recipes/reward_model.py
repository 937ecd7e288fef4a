"""The ``reward_model`` role of the ``rl`` recipe (``reward.model``): a frozen sequence-classification
model that scores each sample's prompt + response at its last token, alone or added to ``reward.terms``;
the policy's token ids as they are, or re-tokenized when the reward model's tokenizer differs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig
from transformers import AutoConfig

from trellis.batch import Batch, last_valid_index
from trellis.config import ConfigError
from trellis.recipes.options import check_not_a_run
from trellis.recipes.reward_inputs import RewardInputs, retokenize_reason
from trellis.recipes.teacher import load_tokenizer
from trellis.rewards import RESERVED_KEYS, RewardManager, RewardResult
from trellis.runtime.controller import WorkerGroup

ROLE = "reward_model"  # also the name trainer.separate_pools gives a pool of its own under Ray


def check_reward_model(cfg: DictConfig) -> None:
    """``reward.model.path`` (when set) is a one-label sequence-classification folder with a
    tokenizer (and a chat template when it is not the actor's), in a single-turn run;
    ``trainer.separate_pools`` names ``reward_model`` only when there is one. Reads config and
    tokenizer files only: no model is built."""
    path = cfg.reward.model.path
    if not path:
        if ROLE in cfg.trainer.separate_pools:
            raise ConfigError(
                f"config key 'trainer.separate_pools' lists {ROLE!r}, but reward.model.path is empty, so there is no reward model "
                f"to place; set reward.model.path=<folder> or take {ROLE!r} out of trainer.separate_pools"
            )
        return
    key, terms = cfg.reward.model.key, [t.get("key") or t.get("name") for t in cfg.reward.terms]
    if key in RESERVED_KEYS or "/" in key or key in terms:
        raise ConfigError(
            f"config key 'reward.model.key' is {key!r}, a metric of its own, holding '/' or a term's key; set reward.model.key to another name"
        )
    check_not_a_run(Path(path), "reward.model.path")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"config key 'reward.model.path' is {path!r}, which is not a Hugging Face model folder (no config.json); give the folder")
    config = AutoConfig.from_pretrained(path)
    architectures = config.architectures or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures) or config.num_labels != 1:
        raise ConfigError(
            f"config key 'reward.model.path' is {path!r}, a {', '.join(architectures) or 'model'} with {config.num_labels} labels; "
            "a reward model is a sequence-classification folder with one label (the rm recipe writes one: trainer.save_hf_model=true)"
        )
    if cfg.multi_turn.enable:
        raise ConfigError(
            "config key 'reward.model.path' is set with multi_turn.enable=true: the reward model is trained on and scores single "
            "answers, not conversations with environment turns; unset reward.model.path for multi-turn runs"
        )
    reward_inputs(cfg, load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, "model.tokenizer_path or model.path"))


def reward_inputs(cfg: DictConfig, policy) -> RewardInputs | None:
    """The re-tokenisation of rollouts for ``reward.model.path`` when its tokenizer differs from
    the policy's (``retokenize_reason``) or ``reward.model.layout`` is ``conversation``, its
    samples cut to the model's context (``max_position_embeddings``, or the tokenizer's
    ``model_max_length`` when smaller); None when the reward model scores the policy's token ids
    as they are."""
    path, conversation = cfg.reward.model.path, cfg.reward.model.layout == "conversation"
    reward = load_tokenizer(path, "reward.model.path")
    why = "reward.model.layout is conversation" if conversation else retokenize_reason(policy, reward)
    if not why:
        return None
    if not getattr(reward, "chat_template", None):
        raise ConfigError(
            f"config key 'reward.model.path' is {path!r}: samples are re-rendered with its chat template ({why}), but it has "
            "none; give the folder one (chat_template.jinja)"
        )
    config = AutoConfig.from_pretrained(path)
    limits = [n for n in (getattr(config, "max_position_embeddings", None), reward.model_max_length) if n and n < 10**9]
    if not limits:
        raise ConfigError(
            f"config key 'reward.model.path' is {path!r}, whose config and tokenizer give no maximum length "
            "(max_position_embeddings, model_max_length); set tokenizer_config.json's model_max_length"
        )
    return RewardInputs(policy, reward, min(limits), conversation)


class ModelReward:
    """The reward of a run with ``reward.model``: the role's score of each sample (``(batch,)``,
    its head at the sample's last attended token), times ``weight``, plus the functions' reward
    (``functions``: a manager of ``reward.terms``, or None when the model alone is the reward).
    ``inputs``: what the role reads from a rollout batch (``RewardInputs``: re-tokenized for the
    reward model's own tokenizer), or None for the batch's own token ids.
    ``score(batch)`` returns a ``RewardResult`` as ``RewardManager.score`` does, the model's
    unweighted score as the component and metric ``reward/<key>``."""

    def __init__(
        self, role: WorkerGroup, weight: float, key: str, functions: RewardManager | None, inputs: Callable[[Batch], Batch] | None = None
    ) -> None:
        self.role, self.weight, self.key, self.functions, self.inputs = role, float(weight), key, functions, inputs

    def score(self, batch: Batch) -> RewardResult:
        inputs = batch if self.inputs is None else self.inputs(batch)
        self.role.onload()  # scoring happens while the engines generate, when roles are offloaded
        try:
            raw = self.role.score(inputs)["scores"].float()
        finally:
            self.role.offload()
        mask = batch["response_mask"]
        base = self.functions.score(batch) if self.functions is not None else None
        scores = self.weight * raw + (base.scores if base is not None else 0.0)
        token_scores = base.token_scores.clone() if base is not None else torch.zeros(mask.shape, dtype=torch.float32)
        last = last_valid_index(mask)
        rows = (last >= 0).nonzero().flatten()
        token_scores[rows, last[rows]] += self.weight * raw[rows]
        metrics = base.metrics if base is not None else {"reward/errors": 0.0, "reward/error_rate": 0.0}
        metrics = {
            **metrics,
            "reward/mean": float(scores.mean()),
            "reward/max": float(scores.max()),
            "reward/min": float(scores.min()),
            f"reward/{self.key}": float(raw.mean()),
        }
        components = {**((base.components or {}) if base is not None else {}), self.key: raw}
        return RewardResult(token_scores, metrics, scores, components)
