"""Tokenizers of a run's folders: the policy's (``model.tokenizer_path``, else ``model.path``), any
folder's with a config error naming its key, and what differs between two."""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer

from trellis import ConfigError

POLICY_TOKENIZER_KEY = "model.tokenizer_path or model.path"


def policy_tokenizer_path(cfg: Any) -> str:
    """The folder of the policy's tokenizer in a run config (``model.tokenizer_path``, else ``model.path``)."""
    return cfg.model.tokenizer_path or cfg.model.path


def policy_tokenizer(cfg: Any):
    """The policy's tokenizer, from :func:`policy_tokenizer_path`."""
    return AutoTokenizer.from_pretrained(policy_tokenizer_path(cfg))


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
