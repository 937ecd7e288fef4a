"""Data files in verl's schema and left padding (the recipes' prompt datasets and loaders: tests/algos/test_prompts.py;
SFT samples: tests/algos/test_sft_data.py)."""

from __future__ import annotations

import json

import pytest

from trellis.data import DataError, left_pad, load_rows
from trellis_demo.tasks import make_arithmetic_split, write_rows

PROMPT_COLUMNS = ("prompt", "data_source", "reward_model.ground_truth")  # verl's, dotted into nested dicts


# -- files -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_round_trip_and_several_files(tmp_path, suffix):
    rows = make_arithmetic_split(12, seed=0)
    a = write_rows(rows[:5], tmp_path / f"a{suffix}")
    b = write_rows(rows[5:], tmp_path / f"b{suffix}")
    assert load_rows(a, required=PROMPT_COLUMNS) == rows[:5]
    assert load_rows([a, b]) == rows


def test_missing_file_and_missing_column_name_file_column_and_fix(tmp_path):
    with pytest.raises(DataError, match=r"'.*nope\.parquet' does not exist; give the path of a \.parquet or \.jsonl file"):
        load_rows(tmp_path / "nope.parquet")
    rows = make_arithmetic_split(3, seed=0)
    del rows[2]["reward_model"]["ground_truth"]
    path = write_rows(rows, tmp_path / "d.jsonl")
    with pytest.raises(DataError) as err:
        load_rows(path, required=PROMPT_COLUMNS)
    assert str(path) in str(err.value) and "row 2 has no column 'reward_model.ground_truth'" in str(err.value)
    assert "add it to every row" in str(err.value)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(DataError, match="row 0 has no column 'prompt'"):
        load_rows(tmp_path / "chat.jsonl")
    (tmp_path / "msgs.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    assert len(load_rows(tmp_path / "msgs.jsonl")) == 1  # chat SFT data needs no prompt column


def test_bad_jsonl_line_and_unknown_suffix(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2 is not valid JSON"):
        load_rows(tmp_path / "d.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown format '.csv'; use .parquet or .jsonl"):
        load_rows(tmp_path / "d.csv")


def test_left_pad_helper():
    i, m, p = left_pad([[5], [6, 7, 8]], pad_id=0)
    assert i.tolist() == [[0, 0, 5], [6, 7, 8]] and m.tolist() == [[0, 0, 1], [1, 1, 1]] and p.tolist() == [[0, 0, 0], [0, 1, 2]]
