"""Synthetic tasks with checkable answers, in verl's data schema: arithmetic for the demo and tests.

A row reads::

    {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "12+34="}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "46"},
     "extra_info": {"split": "train", "index": 0, "question": "12+34=", "answer": "#### 46", "noisy": False}}

The answer the model is taught (``extra_info.answer``) is ``#### 46``, so verl's GSM8K rule
(reward ``gsm8k``) scores it. Each question belongs to the train or the test split by a hash of
its text, so the splits are disjoint whatever the seeds, and the test split of a question space
never changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

OPS = ("+", "-", "*")
_MAX_ENUMERATE = 200_000  # question spaces up to this size are enumerated, larger ones sampled


def make_arithmetic_split(
    n: int,
    seed: int,
    *,
    split: str = "train",
    ops: Sequence[str] = ("+",),
    min_value: int = 0,
    max_value: int = 99,
    nonnegative: bool = True,
    test_fraction: float = 0.1,
    noisy_answer: float = 0.0,
    noise_max_offset: int = 9,
    data_source: str = "arithmetic",
    interaction: str | None = None,
) -> list[dict[str, Any]]:
    """``n`` rows of ``a<op>b=`` questions with operands in ``[min_value, max_value]``, deterministic by ``seed``.

    split: ``"train"`` or ``"test"``; a question is in ``test`` when a hash of its text falls in
        the lowest ``test_fraction`` of the hash range, so the splits never share a question.
    nonnegative: for ``-``, only questions with ``a >= b`` (no negative answers).
    noisy_answer: probability that a row's taught answer (``extra_info.answer``) is wrong: the
        correct result plus a random non-zero offset in ``[-noise_max_offset, noise_max_offset]``
        (kept >= 0 when ``nonnegative``). ``reward_model.ground_truth`` stays correct. Used to give an
        SFT model a mixture of right and wrong answers that RL can sharpen. Default 0.
    interaction: for multi-turn runs, the interaction each row picks: ``extra_info.interaction_kwargs``
        becomes ``{name, query, ground_truth}`` (verl's GSM8K multi-turn schema).
    Questions are distinct while the split has enough of them; past that they repeat in a fresh
    shuffled order (each noisy row draws its own offset).
    """
    _check(n, split, ops, min_value, max_value, test_fraction, noisy_answer, noise_max_offset)
    rng = random.Random(f"arithmetic:{split}:{seed}")
    questions = _questions(n, rng, split, tuple(ops), min_value, max_value, nonnegative, test_fraction)
    rows = []
    for i, (a, op, b) in enumerate(questions):
        question = f"{a}{op}{b}="
        result = _apply(a, op, b)
        taught, noisy = result, False
        if noisy_answer > 0 and rng.random() < noisy_answer:
            offsets = [d for d in range(-noise_max_offset, noise_max_offset + 1) if d and (not nonnegative or result + d >= 0)]
            taught, noisy = result + rng.choice(offsets), True
        extra_info: dict[str, Any] = {"split": split, "index": i, "question": question, "answer": f"#### {taught}", "noisy": noisy}
        if interaction is not None:
            extra_info["interaction_kwargs"] = {"name": interaction, "query": question, "ground_truth": str(result)}
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(result)},
                "extra_info": extra_info,
            }
        )
    return rows


def task_texts(
    n: int = 2000,
    seed: int = 0,
    *,
    ops: Sequence[str] = OPS,
    min_value: int = 0,
    max_value: int = 99,
    nonnegative: bool = True,
) -> list[str]:
    """Text to train a tokenizer on: questions and ``#### answer`` lines of the arithmetic task
    (train split), covering every digit and operator in ``ops``. Deterministic by ``seed``."""
    rows = make_arithmetic_split(n, seed, ops=ops, min_value=min_value, max_value=max_value, nonnegative=nonnegative)
    texts = []
    for r in rows:
        texts.append(r["prompt"][0]["content"])
        texts.append(r["extra_info"]["answer"])
    texts.append(" ".join(["0123456789", *ops, "=", "-", "####"]))  # every symbol, even if n is tiny
    return texts


def make_arithmetic_pairs(rows: Sequence[dict[str, Any]], seed: int, max_offset: int = 9) -> list[dict[str, Any]]:
    """Preference pairs (the ``rm`` recipe's format) from arithmetic rows: each row's prompt, the
    right answer ``#### <result>`` chosen, and a wrong one (the result plus a random non-zero
    offset in ``[-max_offset, max_offset]``, kept >= 0 when the result is) rejected, as answer
    messages. Deterministic by ``seed``."""
    rng = random.Random(f"arithmetic-pairs:{seed}")
    pairs = []
    for row in rows:
        result = int(row["reward_model"]["ground_truth"])
        offsets = [d for d in range(-max_offset, max_offset + 1) if d and (result < 0 or result + d >= 0)]
        wrong = result + rng.choice(offsets)
        pairs.append(
            {
                "prompt": row["prompt"],
                "chosen": [{"role": "assistant", "content": f"#### {result}"}],
                "rejected": [{"role": "assistant", "content": f"#### {wrong}"}],
            }
        )
    return pairs


def write_rows(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write ``rows`` to ``path``: ``.parquet`` (pyarrow) or ``.jsonl`` / ``.json`` (one object a line).

    The file is written to a temporary name and renamed, so readers never see half a file.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".parquet", ".jsonl", ".json"):
        raise ValueError(f"write_rows: cannot tell the format of {str(path)!r}; use a .parquet or .jsonl suffix")
    if not rows:
        raise ValueError(f"write_rows: no rows to write to {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(list(rows)), tmp)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def in_test_split(question: str, test_fraction: float) -> bool:
    """Whether ``question`` belongs to the test split (a fixed hash of its text, independent of seeds)."""
    h = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big")
    return h < test_fraction * 2**64


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _questions(
    n: int, rng: random.Random, split: str, ops: tuple[str, ...], lo: int, hi: int, nonneg: bool, test_fraction: float
) -> list[tuple[int, str, int]]:
    want_test = split == "test"

    def ok(a: int, op: str, b: int) -> bool:
        return not (nonneg and op == "-" and a < b) and in_test_split(f"{a}{op}{b}=", test_fraction) == want_test

    width = hi - lo + 1
    if len(ops) * width * width <= _MAX_ENUMERATE:
        pool = [(a, op, b) for op in ops for a in range(lo, hi + 1) for b in range(lo, hi + 1) if ok(a, op, b)]
        if not pool:
            raise ValueError(
                f"the {split} split of this question space is empty (ops={list(ops)}, values {lo}..{hi}, "
                f"test_fraction={test_fraction}); widen the value range or change test_fraction"
            )
        out: list[tuple[int, str, int]] = []
        while len(out) < n:
            order = pool[:]
            rng.shuffle(order)
            out.extend(order[: n - len(out)])
        return out
    seen: set[tuple[int, str, int]] = set()
    out = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(f"could not draw {n} distinct {split} questions; lower n or widen the value range")
        q = (rng.randint(lo, hi), rng.choice(ops), rng.randint(lo, hi))
        if q not in seen and ok(*q):
            seen.add(q)
            out.append(q)
    return out


def _check(n: int, split: str, ops: Sequence[str], lo: int, hi: int, test_fraction: float, noisy: float, offset: int) -> None:
    if n <= 0:
        raise ValueError(f"make_arithmetic_split: n={n} must be positive")
    if split not in ("train", "test"):
        raise ValueError(f"make_arithmetic_split: split={split!r}; use 'train' or 'test'")
    bad = [op for op in ops if op not in OPS]
    if bad or not ops:
        raise ValueError(f"make_arithmetic_split: ops={list(ops)}; each op must be one of {list(OPS)}")
    if lo < 0 or hi < lo:
        raise ValueError(f"make_arithmetic_split: value range {lo}..{hi}; need 0 <= min_value <= max_value")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"make_arithmetic_split: test_fraction={test_fraction} must be strictly between 0 and 1")
    if not 0.0 <= noisy <= 1.0:
        raise ValueError(f"make_arithmetic_split: noisy_answer={noisy} is a probability; use a value in [0, 1]")
    if offset < 1:
        raise ValueError(f"make_arithmetic_split: noise_max_offset={offset} must be >= 1")
