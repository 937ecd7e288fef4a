"""The ``teacher`` role of the ``rl`` recipe: a frozen model from another folder that scores the
actor's own samples, for advantage estimators that declare the need ``"teacher_log_probs"``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from transformers import AutoTokenizer

from trellis.config import ConfigError

TEACHER_NEED = "teacher_log_probs"


@dataclass
class TeacherConfig:
    """path: a Hugging Face model folder with the actor's tokenizer, built frozen (the actor's
    micro-batching, no optimizer) when the advantage estimator needs ``teacher_log_probs``."""

    path: str = ""


def check_teacher(cfg: DictConfig, declared: tuple[str, ...]) -> None:
    """A teacher exactly when the estimator reads one, and with the actor's tokenizer: the teacher
    scores the actor's token ids, which mean the same text only under one tokenizer."""
    name, path = cfg.algorithm.advantage.name, cfg.teacher.path
    if TEACHER_NEED in declared and not path:
        raise ConfigError(
            f"config key 'teacher.path' is empty, but advantage {name!r} scores the actor's samples with a teacher; "
            "set teacher.path=<model folder> of a model with the actor's tokenizer"
        )
    if path and TEACHER_NEED not in declared:
        raise ConfigError(
            f"config key 'teacher.path' is {path!r}, but advantage {name!r} reads no teacher log-probs; unset teacher.path, "
            f"or choose an advantage that declares the need {TEACHER_NEED!r}"
        )
    if path:
        check_actor_tokenizer(
            cfg, "teacher.path", path,
            "the teacher scores the actor's token ids, so both must share one tokenizer: choose a teacher with the actor's tokenizer",
        )  # fmt: skip


def check_actor_tokenizer(cfg: DictConfig, key: str, path: str, why: str) -> None:
    """Refuse the model folder ``path`` (config key ``key``) when its tokenizer differs from the
    actor's: a role that scores the actor's token ids needs the same ids to mean the same text.
    ``why`` ends the error: what the role does with the ids and what to choose instead."""
    actor = cfg.model.tokenizer_path or cfg.model.path
    differ = tokenizer_difference(load_tokenizer(actor, "model.tokenizer_path or model.path"), load_tokenizer(path, key))
    if differ:
        raise ConfigError(f"config key {key!r} is {path!r}, whose tokenizer differs from the actor's in {actor!r} ({differ}); {why}")


def load_tokenizer(path: str, key: str):
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config key {key!r} is {path!r}, which holds no tokenizer: {exc}") from None


def tokenizer_difference(student, teacher) -> str:
    """What differs between two tokenizers (vocabulary, special tokens), or '' if nothing does."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        changed = sum(a.get(token) != i for token, i in b.items()) + len(a.keys() - b.keys())
        return f"vocabularies of {len(a)} and {len(b)} tokens, {changed} tokens with another id or missing"
    if student.special_tokens_map != teacher.special_tokens_map:
        return f"special tokens {student.special_tokens_map} and {teacher.special_tokens_map}"
    return ""


def reverse_kl(old_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``teacher/reverse_kl``: the mean over the actor's sampled tokens of ``log p_actor -
    log p_teacher`` (each ``(batch, response_len)``), a sample estimate of KL(actor || teacher)."""
    mask = mask.float()
    return {"teacher/reverse_kl": float(((old_log_probs - teacher_log_probs) * mask).sum() / mask.sum().clamp(min=1))}
