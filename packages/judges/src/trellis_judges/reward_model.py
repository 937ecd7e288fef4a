"""The reward service ``reward_model`` (``reward.model``): the ``rl`` run's frozen ``reward_model`` role,
a sequence-classification model that scores each sample's prompt + response at its last token, alone
or added to ``reward.terms``; the policy's token ids as they are, or re-tokenized when the reward
model's tokenizer differs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig
from transformers import AutoConfig

from trellis import Batch, ConfigError, RewardResult, Scorer, WorkerGroup, last_valid_index, without_adapter
from trellis.kit.rewards import check_not_a_run
from trellis_algos import POLICY_TOKENIZER_KEY, RESERVED_KEYS, RewardConfig, ServiceContext, load_tokenizer, policy_tokenizer_path
from trellis_judges.reward_inputs import RewardInputs, retokenize_reason

ROLE = "reward_model"  # also the name trainer.separate_pools gives a pool of its own under Ray


def check_reward_model(cfg: DictConfig) -> None:
    """``reward.model.path`` is a one-label sequence-classification folder with a tokenizer (and
    a chat template when it is not the actor's), in a single-turn run. Reads config and tokenizer
    files only: no model is built."""
    path = cfg.reward.model.path
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
    reward_inputs(cfg, load_tokenizer(policy_tokenizer_path(cfg), POLICY_TOKENIZER_KEY))


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

    def __init__(self, role: WorkerGroup, weight: float, key: str, functions: Scorer | None, inputs: Callable[[Batch], Batch] | None = None) -> None:
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


class RewardModel:
    """Reward service ``reward_model``: wanted by a run with ``reward.model.path``; built for the
    run, it spawns the frozen ``reward_model`` role (the actor's micro-batching, no adapter) and
    scores with it, adding the functions' reward when ``reward.terms`` are given."""

    @classmethod
    def wanted(cls, reward: RewardConfig) -> bool:
        return bool(reward.model.path)

    @classmethod
    def check(cls, cfg: DictConfig, registry) -> None:
        check_reward_model(cfg)

    @classmethod
    def served(cls, reward: RewardConfig) -> list:
        return []  # it answers no reward function: it is (part of) the reward

    def __init__(self, reward: RewardConfig, context: ServiceContext) -> None:
        cfg, self.reward = context.cfg, reward
        self.role = context.run.spawn(ROLE, reward.model.path, without_adapter(cfg.actor), head="reward")
        self.inputs = reward_inputs(cfg, context.tokenizer)

    def wrap(self, scorer: Scorer) -> Scorer:
        functions = scorer if self.reward.terms else None  # without terms the model alone is the reward
        return ModelReward(self.role, self.reward.model.weight, self.reward.model.key, functions, self.inputs)

    def close(self) -> None:
        pass  # the role is the run's: it goes with the run
