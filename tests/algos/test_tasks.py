"""The arithmetic task: verl's schema, deterministic by seed, disjoint splits, noisy SFT answers."""

from __future__ import annotations

import pytest

from trellis.data import load_rows
from trellis_algos.rewards import gsm8k_score
from trellis_demo.tasks import in_test_split, make_arithmetic_split, task_texts, write_rows


def _question(row):
    return row["prompt"][0]["content"]


def test_row_schema_and_answers():
    rows = make_arithmetic_split(50, seed=0, ops=("+", "-", "*"))
    for i, row in enumerate(rows):
        q = _question(row)
        assert row["data_source"] == "arithmetic" and row["ability"] == "math"
        assert row["prompt"] == [{"role": "user", "content": q}] and q.endswith("=")
        truth = eval(q[:-1])  # the question is plain Python arithmetic
        assert truth >= 0  # nonnegative by default
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(truth)}
        assert row["extra_info"] == {"split": "train", "index": i, "question": q, "answer": f"#### {truth}", "noisy": False}
        assert gsm8k_score("arithmetic", row["extra_info"]["answer"], row["reward_model"]["ground_truth"]) == 1.0
    assert {q[next(i for i, c in enumerate(q) if c in "+-*")] for q in map(_question, rows)} == {"+", "-", "*"}


def test_deterministic_by_seed():
    assert make_arithmetic_split(40, seed=3) == make_arithmetic_split(40, seed=3)
    assert make_arithmetic_split(40, seed=3) != make_arithmetic_split(40, seed=4)


def test_splits_are_disjoint_and_the_test_split_is_fixed():
    train = {_question(r) for r in make_arithmetic_split(3000, seed=0)}
    test = [r for r in make_arithmetic_split(300, seed=0, split="test")]
    assert all(r["extra_info"]["split"] == "test" for r in test)
    test_q = {_question(r) for r in test}
    assert len(train) == 3000 and len(test_q) == 300  # distinct while the split has enough questions
    assert not train & test_q
    other_seed = {_question(r) for r in make_arithmetic_split(300, seed=9, split="test")}
    assert not train & other_seed
    assert all(in_test_split(q, 0.1) for q in test_q | other_seed)


def test_noisy_answers_are_wrong_by_a_nonzero_offset():
    rows = make_arithmetic_split(1000, seed=1, noisy_answer=0.3, noise_max_offset=5)
    noisy = [r for r in rows if r["extra_info"]["noisy"]]
    assert 0.25 < len(noisy) / len(rows) < 0.35
    for r in rows:
        taught = int(r["extra_info"]["answer"].removeprefix("#### "))
        truth = int(r["reward_model"]["ground_truth"])
        assert truth == eval(_question(r)[:-1])  # the ground truth stays correct
        if r["extra_info"]["noisy"]:
            assert 1 <= abs(taught - truth) <= 5 and taught >= 0
        else:
            assert taught == truth
    assert not any(r["extra_info"]["noisy"] for r in make_arithmetic_split(200, seed=1))  # default 0


def test_subtraction_ranges_and_repeats_past_the_pool():
    rows = make_arithmetic_split(30, seed=0, ops=("-",), min_value=10, max_value=20)
    for r in rows:
        a, b = map(int, _question(r)[:-1].split("-"))
        assert 10 <= a <= 20 and 10 <= b <= 20 and a >= b
    tiny = make_arithmetic_split(50, seed=0, min_value=0, max_value=2)  # 9 questions, each served ~5 times
    pool = {f"{a}+{b}=" for a in range(3) for b in range(3)}
    assert len(tiny) == 50 and {_question(r) for r in tiny} == {q for q in pool if not in_test_split(q, 0.1)}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"split": "val"}, "use 'train' or 'test'"),
        ({"ops": ("/",)}, "each op must be one of"),
        ({"min_value": 5, "max_value": 1}, "min_value <= max_value"),
        ({"noisy_answer": 1.5}, "noisy_answer=1.5 is a probability"),
    ],
)
def test_bad_arguments_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_arithmetic_split(10, seed=0, **kwargs)


def test_large_value_ranges_are_sampled():
    rows = make_arithmetic_split(100, seed=0, min_value=1000, max_value=9999)
    assert len({_question(r) for r in rows}) == 100
    assert all(not in_test_split(_question(r), 0.1) for r in rows)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_write_rows_round_trip(tmp_path, suffix):
    rows = make_arithmetic_split(20, seed=0, noisy_answer=0.5)
    path = write_rows(rows, tmp_path / "sub" / f"train{suffix}")
    assert load_rows(path) == rows
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


def test_write_rows_rejects_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match="use a .parquet or .jsonl suffix"):
        write_rows([{"a": 1}], tmp_path / "x.csv")


def test_task_texts_cover_every_symbol():
    texts = task_texts(20, seed=0)
    joined = "".join(texts)
    assert all(c in joined for c in "0123456789+-*=#")
    assert "#### " in joined and texts == task_texts(20, seed=0)
