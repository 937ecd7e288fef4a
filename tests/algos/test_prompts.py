"""The recipes' prompts (trellis_algos.prompts): verl-schema rows tokenized with the chat template and
left-padded, a prompt encoder's inputs, deterministic resumable loaders."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from hand_tokens import prompt_tokens, row, tiny_tokenizer

from trellis import DataError
from trellis_algos import PromptDataset, PromptLoader
from trellis_demo.tasks import make_arithmetic_split


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


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
