"""The ``teacher`` role of the ``rl`` recipe: a frozen model from another folder that scores the
actor's own samples, for advantage estimators that declare the need ``"teacher_log_probs"`` and
for the actor's distillation loss (``actor.distill``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from trellis import Batch, ConfigError
from trellis.kit.rewards import check_not_a_run
from trellis_algos.tokenizers import POLICY_TOKENIZER_KEY, load_tokenizer, policy_tokenizer_path, tokenizer_difference

TEACHER_NEED = "teacher_log_probs"


@dataclass
class TeacherConfig:
    """path: a Hugging Face model folder with the actor's tokenizer, built frozen (the actor's
    micro-batching, no optimizer) when the advantage estimator needs ``teacher_log_probs``."""

    path: str = ""


def wants_teacher(cfg: DictConfig, declared: tuple[str, ...]) -> bool:
    """Whether the run needs a teacher: the advantage estimator reads its log-probs, or the
    actor's loss has a distillation term (``actor.distill.coef`` > 0)."""
    return TEACHER_NEED in declared or cfg.actor.distill.coef > 0


def check_teacher(cfg: DictConfig, declared: tuple[str, ...]) -> None:
    """A teacher exactly when the estimator or the actor's distillation term reads one, and with
    the actor's tokenizer: the teacher scores the actor's token ids, which mean the same text only
    under one tokenizer."""
    name, path = cfg.algorithm.advantage.name, cfg.teacher.path
    reader = f"advantage {name!r} scores" if TEACHER_NEED in declared else "actor.distill.coef > 0 compares"
    if wants_teacher(cfg, declared) and not path:
        raise ConfigError(
            f"config key 'teacher.path' is empty, but {reader} the actor's samples with a teacher; "
            "set teacher.path=<model folder> of a model with the actor's tokenizer"
        )
    if path and not wants_teacher(cfg, declared):
        raise ConfigError(
            f"config key 'teacher.path' is {path!r}, but advantage {name!r} reads no teacher log-probs and actor.distill.coef is 0; "
            f"unset teacher.path, set actor.distill.coef above 0 (a distillation loss), or choose an advantage that declares "
            f"the need {TEACHER_NEED!r}"
        )
    if path:
        check_not_a_run(Path(path), "teacher.path")
        check_actor_tokenizer(
            cfg, "teacher.path", path,
            "the teacher scores the actor's token ids, so both must share one tokenizer: choose a teacher with the actor's tokenizer",
        )  # fmt: skip


def check_actor_tokenizer(cfg: DictConfig, key: str, path: str, why: str) -> None:
    """Refuse the model folder ``path`` (config key ``key``) when its tokenizer differs from the
    actor's: a role that scores the actor's token ids needs the same ids to mean the same text.
    ``why`` ends the error: what the role does with the ids and what to choose instead."""
    actor = policy_tokenizer_path(cfg)
    differ = tokenizer_difference(load_tokenizer(actor, POLICY_TOKENIZER_KEY), load_tokenizer(path, key))
    if differ:
        raise ConfigError(f"config key {key!r} is {path!r}, whose tokenizer differs from the actor's in {actor!r} ({differ}); {why}")


def score_samples(teacher: Any, batch: Batch, top_k: int | None) -> dict[str, float]:
    """The teacher's log-probs of the actor's samples into ``batch``: ``teacher_log_probs``
    ``(batch, response_len)`` and, with ``top_k`` (not None; 0 = the whole vocabulary), its
    ``top_k`` most likely tokens at every response position: ids ``top_ids`` and log-probs
    ``teacher_top_log_probs``, ``(batch, response_len, k)`` each. Returns ``teacher/reverse_kl``:
    the mean over the sampled tokens of ``log p_actor - log p_teacher``, a one-sample estimate of
    KL(actor || teacher), the actor's log-probs those it sampled with (``old_log_probs``, else the
    engine's ``rollout_log_probs``)."""
    if top_k is None:
        batch["teacher_log_probs"] = teacher.log_prob(batch)["log_probs"]
    else:
        batch.meta["top_k"] = top_k
        out = teacher.forward(batch, ("log_probs", "top_log_probs", "top_ids"))
        batch["teacher_log_probs"], batch["top_ids"], batch["teacher_top_log_probs"] = out["log_probs"], out["top_ids"], out["top_log_probs"]
    actor = batch.get("old_log_probs")
    actor = batch.get("rollout_log_probs") if actor is None else actor
    if actor is None:
        return {}
    mask = batch["response_mask"]
    return {"teacher/reverse_kl": float(((actor - batch["teacher_log_probs"]) * mask).sum() / mask.sum().clamp(min=1))}
