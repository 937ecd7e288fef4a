"""Shared fixtures: a tiny local model (random Qwen2 + trained tokenizer), built once per session."""

from __future__ import annotations

import pytest
import torch

TEXTS = [f"{a}+{b}={a + b} #### {a + b}" for a in range(0, 60, 7) for b in range(0, 60, 5)]


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from trellis.examples.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", TEXTS, hidden_size=32, num_layers=2, seed=0))


@pytest.fixture(scope="session")
def tiny_untied_model_path(tmp_path_factory):
    from trellis.examples.tiny import make_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny-untied"
    return str(make_tiny_model(path, TEXTS, hidden_size=32, num_layers=2, seed=1, tie_word_embeddings=False))


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def make_prompts():
    """``make_prompts(tokenizer, texts)``: a prompt Batch (``input_ids``, ``attention_mask``,
    ``position_ids``) left-padded by hand."""
    return _left_padded_prompts


def _left_padded_prompts(tokenizer, texts):
    from trellis.batch import Batch

    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return Batch({"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, {"text": texts})
