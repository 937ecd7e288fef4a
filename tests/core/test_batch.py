"""Batch keeps tensors and Python fields in lockstep through every reshaping operation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trellis.batch import Batch


def make(n: int) -> Batch:
    ids = torch.arange(n * 3).view(n, 3)
    return Batch(
        {"ids": ids, "mask": torch.ones(n, 3, dtype=torch.long)},
        {"tag": [f"s{i}" for i in range(n)], "info": [{"i": i} for i in range(n)]},
        meta={"temperature": 0.7},
    )


def assert_lockstep(b: Batch) -> None:
    # row i's first id is 3*k where k is the original index named in its tag
    for row, tag, info in zip(b["ids"], b["tag"], b["info"]):
        k = int(tag[1:])
        assert int(row[0]) == 3 * k and info == {"i": k}


def test_index_forms():
    b = make(5)
    assert list(b[1:3]["tag"]) == ["s1", "s2"]
    assert list(b[[4, 0]]["tag"]) == ["s4", "s0"]
    assert list(b[torch.tensor([True, False, True, False, False])]["tag"]) == ["s0", "s2"]
    assert list(b[np.array([3])]["tag"]) == ["s3"]
    assert len(b[2]) == 1 and b[2].meta == {"temperature": 0.7}
    with pytest.raises(KeyError, match="Batch has no field 'nope'"):
        b["nope"]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), size=st.integers(1, 5), seed=st.integers(0, 1000), reps=st.integers(1, 4))
def test_reshaping_keeps_lockstep(n, size, seed, reps):
    b = make(n)
    parts = b.split(size)
    assert [len(p) for p in parts] == [min(size, n - i) for i in range(0, n, size)]
    for p in parts:
        assert_lockstep(p)
    whole = Batch.cat(parts)
    assert torch.equal(whole["ids"], b["ids"]) and list(whole["tag"]) == list(b["tag"])
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    shuffled = b.reorder(perm)
    assert_lockstep(shuffled)
    assert [int(t[1:]) for t in shuffled["tag"]] == perm.tolist()
    rep = b.repeat_interleave(reps)
    assert len(rep) == n * reps
    assert_lockstep(rep)
    assert [int(t[1:]) for t in rep["tag"]] == [i for i in range(n) for _ in range(reps)]


def test_chunk_requires_divisible():
    assert [len(c) for c in make(6).chunk(3)] == [2, 2, 2]
    with pytest.raises(ValueError, match="cannot cut a batch of 5 samples into 2 equal chunks"):
        make(5).chunk(2)


def test_cat_refuses_different_fields():
    a, b = make(2), make(2).select("ids", "tag")
    with pytest.raises(ValueError, match="different fields"):
        Batch.cat([a, b])


def test_mismatched_lengths_refused():
    with pytest.raises(ValueError, match="disagree on the number of samples"):
        Batch({"ids": torch.zeros(3, 2)}, {"tag": ["a", "b"]})
    b = make(3)
    with pytest.raises(ValueError, match="field 'x' has 2 samples, the batch has 3"):
        b["x"] = torch.zeros(2)


def test_update_and_select():
    b = make(3)
    b.update(Batch({"log_probs": torch.ones(3, 2)}, {"score": [1, 2, 3]}))
    assert set(b.keys()) == {"ids", "mask", "tag", "info", "log_probs", "score"}
    s = b.select("log_probs", "score")
    assert set(s.keys()) == {"log_probs", "score"}


def test_trim_drops_all_padding_columns():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    b = Batch({"mask": mask, "ids": torch.arange(8).view(2, 4)}, {"tag": ["a", "b"]})
    t = b.trim("mask", "ids")
    assert t["ids"].tolist() == [[0, 1], [4, 5]] and t["mask"].shape == (2, 2)
    left = Batch({"mask": mask.flip(-1), "ids": torch.arange(8).view(2, 4)}).trim("mask", "ids", side="left")
    assert left["ids"].tolist() == [[2, 3], [6, 7]]


def test_split_by_tokens_respects_budget():
    # lengths 3, 1, 4, 2, 2 with a budget of 6 padded tokens:
    # [3,1] -> 2*3=6 ok, +4 -> 3*4=12 > 6: new; [4] +2 -> 2*4=8 > 6: new; [2,2] -> 4 ok
    lengths = [3, 1, 4, 2, 2]
    mask = torch.tensor([[1] * n + [0] * (4 - n) for n in lengths])
    b = Batch({"mask": mask}, {"tag": [str(n) for n in lengths]})
    groups = b.split_by_tokens(6, "mask")
    assert [list(g["tag"]) for g in groups] == [["3", "1"], ["4"], ["2", "2"]]


def test_cat_with_padding_right_pads_differing_widths():
    a = Batch({"ids": torch.tensor([[1, 2, 3]]), "mask": torch.tensor([[1, 1, 0]]), "score": torch.tensor([0.5])}, {"tag": ["a"]})
    b = Batch({"ids": torch.tensor([[4, 5, 6, 7, 8]]), "mask": torch.tensor([[1, 1, 1, 1, 1]]), "score": torch.tensor([1.0])}, {"tag": ["b"]})
    with pytest.raises(RuntimeError):
        Batch.cat([a, b])
    out = Batch.cat([a, b], pad=True)
    assert out["ids"].tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    assert out["mask"].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert out["score"].tolist() == [0.5, 1.0] and list(out["tag"]) == ["a", "b"]
