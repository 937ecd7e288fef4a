"""The sft recipe's data: loss masks by hand, response columns and chat messages, truncation, packing, resumable loaders."""

from __future__ import annotations

import logging

import pytest
import torch
from hand_tokens import ids, prompt_tokens, row, tiny_tokenizer

from trellis.data import DataError
from trellis_algos.sft_data import SFTDataset, SFTLoader, sft_batches
from trellis_demo.tasks import make_arithmetic_split


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_sft_loss_mask_by_hand(tok):
    ds = SFTDataset([row("1+2=", "#### 3"), row("10+20=", "#### 30")], tok)
    first = prompt_tokens(tok, "1", "+", "2", "=") + ids(tok, "####", "Ġ", "3", "<|im_end|>")
    assert ds[0]["input_ids"] == first and ds[0]["loss_mask"] == [0] * 12 + [1] * 4
    batch = SFTLoader(ds, 2, seed=0, shuffle=False).next_batch()
    second = prompt_tokens(tok, "1", "0", "+", "2", "0", "=") + ids(tok, "####", "Ġ", "3", "0", "<|im_end|>")
    assert batch["input_ids"].tolist() == [first + [0, 0, 0], second]  # right-padded with <|endoftext|> (0)
    assert batch["attention_mask"].tolist() == [[1] * 16 + [0] * 3, [1] * 19]
    assert batch["loss_mask"].tolist() == [[0] * 12 + [1] * 4 + [0] * 3, [0] * 14 + [1] * 5]
    assert batch["position_ids"][1].tolist() == list(range(19)) and batch["position_ids"][0, :16].tolist() == list(range(16))
    assert batch.meta["num_loss_tokens"] == 9 and list(batch["index"]) == [0, 1]


def test_sft_response_key_and_messages(tok):
    ds = SFTDataset([{"prompt": [{"role": "user", "content": "1+2="}], "response": "#### 3"}], tok)
    assert sum(ds[0]["loss_mask"]) == 4
    ds = SFTDataset([{"prompt": "1+2=", "target": "#### 3", "extra_info": {"answer": "#### 9"}}], tok, response_key="target")
    assert tok.decode([t for t, m in zip(ds[0]["input_ids"], ds[0]["loss_mask"]) if m]) == "#### 3<|im_end|>"
    with pytest.raises(DataError, match="SFT row 0 has no target column 'response'.*set data.response_key to"):
        SFTDataset([{"prompt": "1+2="}], tok)

    chat = [
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "#### 3"},
        {"role": "user", "content": "4+5="},
        {"role": "assistant", "content": "#### 9"},
    ]
    item = SFTDataset([{"messages": chat}], tok)[0]
    assert tok.decode(item["input_ids"]) == tok.apply_chat_template(chat, tokenize=False)
    learned = [tok.convert_ids_to_tokens(t) for t, m in zip(item["input_ids"], item["loss_mask"]) if m]
    assert learned == ["####", "Ġ", "3", "<|im_end|>", "####", "Ġ", "9", "<|im_end|>"]  # not the newline after <|im_end|>


def test_sft_truncation_warns_with_counts(tok, caplog):
    rows = [row("1+2=", "#### 3"), row("1+2=", "#### 123456789"), row("123456789+1=", "#### 1")]
    with caplog.at_level(logging.WARNING, logger="trellis"):
        ds = SFTDataset(rows, tok, max_length=17)
    msg = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msg) == 1 and "2 of 3 samples were longer than max_length=17" in msg[0] and "(1 lost every response token" in msg[0]
    assert [it["index"] for it in ds.items] == [0, 1] and len(ds[1]["input_ids"]) == 17 and sum(ds[1]["loss_mask"]) == 5


def test_sft_packing(tok):
    rows = make_arithmetic_split(12, seed=0)
    ds = SFTDataset(rows, tok, max_length=48)
    padded = SFTLoader(ds, 6, seed=3)
    packed = SFTLoader(ds, 6, seed=3, pack=True)
    for _ in range(3):
        p, q = padded.next_batch(), packed.next_batch()
        assert q["input_ids"].shape[1] <= 48 and len(q) < len(p)
        assert sorted(sum(map(list, q["index"]), [])) == sorted(p["index"])  # the same samples, laid out differently
        assert int(q["loss_mask"].sum()) == int(p["loss_mask"].sum()) == q.meta["num_loss_tokens"]
        for r in range(len(q)):
            seg, pos = q["segment_ids"][r], q["position_ids"][r]
            for k, sample in enumerate(q["index"][r], 1):
                cols = (seg == k).nonzero().flatten()
                item = ds[[it["index"] for it in ds.items].index(sample)]
                assert q["input_ids"][r, cols].tolist() == item["input_ids"]
                assert q["loss_mask"][r, cols].tolist() == item["loss_mask"]
                assert pos[cols].tolist() == list(range(len(cols)))  # restarts per sample
            assert (q["attention_mask"][r] == (seg > 0).long()).all()
        assert q.meta["packed"] and q.meta["num_samples"] == 6
    with pytest.raises(DataError, match="packing needs a row length"):
        SFTLoader(SFTDataset(rows, tok), 2, pack=True)


def test_sft_loader_resumes_and_sft_batches_covers_everything(tok):
    ds = SFTDataset(make_arithmetic_split(7, seed=0), tok)
    a = SFTLoader(ds, 2, seed=5)
    a.next_batch()
    b = SFTLoader(ds, 2, seed=5)
    b.load_state_dict(a.state_dict())
    for _ in range(4):
        assert torch.equal(a.next_batch()["input_ids"], b.next_batch()["input_ids"])
    val = sft_batches(ds, 3)
    assert [len(x) for x in val] == [3, 3, 1] and sum((list(x["index"]) for x in val), []) == list(range(7))
