"""Data: verl-schema files, left-padded prompt batches, deterministic resumable loaders, SFT masks and packing."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from trellis.data import (
    PROMPT_COLUMNS,
    DataError,
    PromptDataset,
    PromptLoader,
    SFTDataset,
    SFTLoader,
    left_pad,
    load_rows,
    sft_batches,
)
from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
from trellis_demo.tiny import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
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


# -- prompts ---------------------------------------------------------------------------------------
def test_left_padding_and_position_ids_by_hand(tok):
    ds = PromptDataset([row("1+2=", "#### 3"), row("10+20=", "#### 30")], tok, max_prompt_length=64)
    batch = PromptLoader(ds, 2, seed=0, shuffle=False).next_batch()
    short = prompt_tokens(tok, "1", "+", "2", "=")  # 12 tokens
    long = prompt_tokens(tok, "1", "0", "+", "2", "0", "=")  # 14 tokens
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    assert batch["input_ids"].tolist() == [[pad, pad, *short], long]
    assert batch["attention_mask"].tolist() == [[0, 0] + [1] * 12, [1] * 14]
    assert batch["position_ids"].tolist() == [[0, 0, *range(12)], list(range(14))]
    assert list(batch["ground_truth"]) == ["3", "30"] and list(batch["data_source"]) == ["arithmetic"] * 2
    assert list(batch["index"]) == [0, 1] and batch["extra_info"][1]["answer"] == "#### 30"
    assert batch["raw_prompt"][0] == [{"role": "user", "content": "1+2="}] and list(batch["ability"]) == ["math"] * 2
    assert batch.meta == {"epoch": 0, "step_in_epoch": 0}


def test_left_pad_helper():
    i, m, p = left_pad([[5], [6, 7, 8]], pad_id=0)
    assert i.tolist() == [[0, 0, 5], [6, 7, 8]] and m.tolist() == [[0, 0, 1], [1, 1, 1]] and p.tolist() == [[0, 0, 0], [0, 1, 2]]


def test_long_prompts_filtered_with_one_counted_warning(tok, caplog):
    rows = [row("1+2="), row("123456789+1="), row("3+4="), row("99999999999+1="), row("5+6=")]
    with caplog.at_level(logging.WARNING, logger="trellis"):
        ds = PromptDataset(rows, tok, max_prompt_length=13)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "filtered 2 of 5 prompts longer than max_prompt_length=13" in warnings[0].getMessage()
    assert [it["index"] for it in ds.items] == [0, 2, 4]
    with pytest.raises(DataError, match="all 5 prompts are longer than max_prompt_length=5 .*raise data.max_prompt_length"):
        PromptDataset(rows, tok, max_prompt_length=5)


def test_prompt_as_plain_string_and_bad_prompt(tok):
    ds = PromptDataset([{"prompt": "1+2=", "data_source": "x"}], tok, 64)
    assert ds[0]["raw_prompt"] == [{"role": "user", "content": "1+2="}] and ds[0]["ground_truth"] is None
    with pytest.raises(DataError, match="row 0 column 'prompt' must be chat messages"):
        PromptDataset([{"prompt": [{"text": "hi"}]}], tok, 64)


def test_a_prompt_encoder_tokenizes_the_rows_and_adds_each_samples_model_inputs(tok):
    """The example plugin's encoder (kind ``prompt_encoder``; trellis-vision's ``images`` reads images
    this way) replaces the tokenizer's rendering, and its per-sample inputs join the batch."""
    from trellis.interfaces.backend import IMAGE_INPUTS
    from trellis.plugins import load_plugins

    encoder = load_plugins().registry.get("prompt_encoder", "example_marked").obj("unused", tok, None)
    batch = PromptDataset([row("1+2="), row("3+45=")], tok, 64, encoder=encoder).as_batch()
    assert batch["input_ids"][1].tolist() == [*prompt_tokens(tok, "3", "+", "4", "5", "="), tok.eos_token_id]
    assert list(batch[IMAGE_INPUTS]) == [{}, {}]
    assert IMAGE_INPUTS not in PromptDataset([row("1+2=")], tok, 64).as_batch()


def _order(loader, batches):
    return [list(loader.next_batch()["index"]) for _ in range(batches)]


def test_deterministic_shuffle_by_seed_and_epoch(tok):
    ds = PromptDataset(make_arithmetic_split(10, seed=0), tok, 64)
    a, b, c = (PromptLoader(ds, 3, seed=s) for s in (1, 1, 2))
    assert len(a) == 3  # drop_last: 10 // 3
    first = _order(a, 6)
    assert first == _order(b, 6) and first != _order(c, 6)
    assert first[:3] != first[3:]  # a new order each epoch
    assert a.epoch == 2 and a.position == 0
    every = PromptLoader(ds, 3, seed=1, drop_last=False)
    assert len(every) == 4 and sorted(sum(_order(every, 4), [])) == list(range(10))
    assert _order(PromptLoader(ds, 5, seed=1, shuffle=False), 2) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_resume_yields_the_same_next_batches(tok):
    ds = PromptDataset(make_arithmetic_split(10, seed=0), tok, 64)
    straight = PromptLoader(ds, 3, seed=4)
    _order(straight, 2)
    state = straight.state_dict()
    assert state == {"epoch": 0, "position": 2, "seed": 4}
    resumed = PromptLoader(ds, 3, seed=999)  # the saved seed wins
    resumed.load_state_dict(json.loads(json.dumps(state)))
    for _ in range(5):  # across the epoch boundary
        x, y = straight.next_batch(), resumed.next_batch()
        assert torch.equal(x["input_ids"], y["input_ids"]) and list(x["index"]) == list(y["index"]) and x.meta == y.meta
    with pytest.raises(DataError, match="does not fit this loader"):
        resumed.load_state_dict({"epoch": 0, "position": 9, "seed": 4})


def test_loader_iterates_across_epochs_and_rejects_tiny_datasets(tok):
    ds = PromptDataset(make_arithmetic_split(4, seed=0), tok, 64)
    it = iter(PromptLoader(ds, 2, seed=0))
    assert [next(it).meta["epoch"] for _ in range(5)] == [0, 0, 1, 1, 2]
    with pytest.raises(DataError, match="fewer than one batch of 8; lower data.train_batch_prompts or add data"):
        PromptLoader(ds, 8, seed=0)


def test_as_batch_keeps_dataset_order(tok):
    ds = PromptDataset(make_arithmetic_split(5, seed=0), tok, 64)
    assert list(ds.as_batch()["index"]) == [0, 1, 2, 3, 4]


# -- SFT -------------------------------------------------------------------------------------------
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
