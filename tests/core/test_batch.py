"""Batch keeps tensors and Python fields in lockstep through every reshaping operation; the mask rules
(positions, last valid token) every module reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rollouts import rollout_round

from trellis.batch import Batch, last_valid_index, position_ids


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


def test_trim_padding_drops_all_padding_columns_of_sequence_and_response_fields():
    # left-padded prompts of width 3, right-padded responses of width 3: column 0 and the last
    # response column are padding in every sample
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0]])
    responses = torch.tensor([[7, 8, 0], [9, 0, 0]])
    b = Batch({"attention_mask": mask, "input_ids": torch.arange(12).view(2, 6), "responses": responses, "score": torch.tensor([1.0, 2.0])})
    t = b.trim_padding()
    assert t["input_ids"].tolist() == [[1, 2, 3, 4], [7, 8, 9, 10]]
    assert t["responses"].tolist() == [[7, 8], [9, 0]] and t["score"].tolist() == [1.0, 2.0]
    # a batch of empty responses keeps one response column, aligned with the sequence's last
    empty = Batch({"attention_mask": torch.tensor([[1, 1, 0]]), "responses": torch.zeros(1, 2, dtype=torch.long)}).trim_padding()
    assert empty["attention_mask"].shape == (1, 2) and empty["responses"].shape == (1, 1)
    # right padding only (SFT rows): the trailing columns go
    sft = Batch({"attention_mask": torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]]), "loss_mask": torch.ones(2, 4)}).trim_padding()
    assert sft["loss_mask"].shape == (2, 2)


def test_split_by_tokens_counts_the_columns_left_after_trimming():
    # sample 0: prompt of 3 + response of 1; sample 1: prompt of 1 + response of 3 (left/right
    # padded to 3 + 3): each has 4 tokens, but together they span 6 columns: 2 x 6 = 12 > 8
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]])
    b = Batch({"mask": mask})
    assert [len(g) for g in b.split_by_tokens(8, "mask")] == [1, 1]
    assert [len(g) for g in b.split_by_tokens(12, "mask")] == [2]


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


def test_positions_count_attended_tokens_and_the_last_valid_index_is_minus_one_for_none():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [0, 1, 0, 1, 0]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3], [0, 0, 0, 0, 0], [0, 0, 0, 1, 1]]
    assert last_valid_index(mask).tolist() == [4, 3, -1, 3]
    assert last_valid_index(torch.zeros(2, 0)).tolist() == [-1, -1]


@pytest.mark.parametrize(
    "rounds",
    [
        # a round of prompt width 2 then one of width 3 (the DAPO reproduction), responses of other widths
        [([[11, 12], [13]], [[21, 22, 23], [24]]), ([[31, 32, 33]], [[41, 42]])],
        # the same total width (2 + 3 and 3 + 2): the merge must still split prompt from response
        [([[11, 12]], [[21, 22, 23]]), ([[31, 32, 33]], [[41, 42]])],
        # three rounds, the widest prompt last
        [([[11]], [[21]]), ([[12, 13]], [[22, 23, 24, 25]]), ([[14, 15, 16, 17]], [[26]])],
    ],
)
def test_rollout_batches_merge_prompt_left_response_right(rounds):
    parts = [rollout_round(p, r, 10 * i) for i, (p, r) in enumerate(rounds)]
    out = Batch.cat(parts, pad=True)
    prompts = [p for ps, _ in rounds for p in ps]
    responses = [r for _, rs in rounds for r in rs]
    width = out["responses"].shape[1]
    assert width == max(map(len, responses)) and out["prompts"].shape[1] == max(map(len, prompts))
    assert out["input_ids"].shape[1] == out["prompts"].shape[1] + width
    for i, (p, r) in enumerate(zip(prompts, responses)):
        row_ids, row_mask = out["input_ids"][i], out["attention_mask"][i].bool()
        assert row_ids[row_mask].tolist() == p + r  # the sample's tokens, in order
        assert out["input_ids"][i, -width:][: len(r)].tolist() == r  # the response is the last response_len columns
        assert out["response_mask"][i].tolist() == [1] * len(r) + [0] * (width - len(r))
        assert out["prompts"][i][out["attention_mask"][i, : out["prompts"].shape[1]].bool()].tolist() == p
        assert out["rollout_log_probs"][i].tolist() == [-0.5] * len(r) + [0.0] * (width - len(r))
    assert torch.equal(out["position_ids"], position_ids(out["attention_mask"]))
    assert out["uid"].tolist() == [u for part in parts for u in part["uid"].tolist()]


def test_a_rollout_field_of_unknown_width_is_refused_by_name():
    a, b = rollout_round([[1, 2]], [[3]]), rollout_round([[1]], [[3, 4]])
    a["hidden"], b["hidden"] = torch.zeros(1, 7), torch.zeros(1, 8)
    with pytest.raises(ValueError, match="field 'hidden' is 7 wide"):
        Batch.cat([a, b], pad=True)


def test_padding_widens_dimension_one_of_wider_fields():
    a = Batch({"top": torch.ones(1, 2, 3)})  # (batch, positions, k)
    b = Batch({"top": torch.ones(1, 4, 3)})
    out = Batch.cat([a, b], pad=True)
    assert out["top"].shape == (2, 4, 3) and out["top"][0].sum() == 6
