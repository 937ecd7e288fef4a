"""A tiny tokenizer of the arithmetic task and token ids written out by hand, for tests that check tokenization."""

from __future__ import annotations

from trellis_demo.tasks import task_texts
from trellis_demo.tiny import make_tiny_tokenizer


def tiny_tokenizer():
    return make_tiny_tokenizer(task_texts(200, seed=0))


def ids(tok, *tokens):
    """Token ids of token strings written out by hand (``Ċ`` is a newline, ``Ġ`` a space)."""
    out = tok.convert_tokens_to_ids(list(tokens))
    assert None not in out and tok.unk_token_id not in out
    return out


def prompt_tokens(tok, *question_chars):
    return ids(tok, "<|im_start|>", "user", "Ċ", *question_chars, "<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ")


def row(question, answer="#### 0", **extra):
    return {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer.removeprefix("#### ")},
        "extra_info": {"index": 7, "answer": answer, **extra},
    }
