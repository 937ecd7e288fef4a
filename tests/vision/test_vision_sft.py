"""The sft recipe on image prompts: a prompt with images plus its answer, the loss on the answer
alone, the images in each batch; the saved model folder keeps the image processor, so the rl
recipe starts from it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
from trellis_vision.prompts import ImagePrompts

from trellis.data import DataError
from trellis.interfaces.backend import IMAGE_INPUTS
from trellis.recipes.train import train
from trellis_algos.sft_data import SFTDataset, SFTLoader
from trellis_demo.shapes import make_shapes_split
from trellis_demo.tasks import write_rows


@pytest.fixture(scope="module")
def encoder(tiny_vision_model_path):
    return ImagePrompts(tiny_vision_model_path, AutoTokenizer.from_pretrained(tiny_vision_model_path), SimpleNamespace(image_key="images"))


def test_sft_samples_with_images_learn_the_answer_alone(encoder):
    rows = make_shapes_split(3, 0)
    dataset = SFTDataset(rows, encoder.tokenizer, max_length=64, encoder=encoder)
    batch = SFTLoader(dataset, 3, shuffle=False).next_batch()
    pad = encoder.image_token_id
    for r, row in enumerate(rows):
        ids, loss = batch["input_ids"][r], batch["loss_mask"][r]
        assert int((ids == pad).sum()) == 6  # 84 x 56 pixels: 6 x 4 patches merged 2 x 2
        learned = encoder.tokenizer.decode(ids[loss.bool()])
        assert learned == row["extra_info"]["answer"] + "<|im_end|>"
        assert batch[IMAGE_INPUTS][r]["image_grid_thw"].tolist() == [[1, 4, 6]]


def test_sft_rows_with_images_that_cannot_train_are_refused_or_dropped(encoder, tiny_model_path, caplog):
    row = make_shapes_split(1, 0)[0]
    with pytest.raises(DataError, match="SFT row 0: chat messages with images are not supported yet"):
        SFTDataset([{**row, "messages": [*row["prompt"], {"role": "assistant", "content": "#### 1"}]}], encoder.tokenizer, encoder=encoder)
    with pytest.raises(DataError, match="SFT row 0 holds images in column 'images', but the model takes text only"):
        SFTDataset([row], AutoTokenizer.from_pretrained(tiny_model_path))
    with pytest.raises(DataError, match="SFT packing does not take samples with images"):
        SFTLoader(SFTDataset([row, row], encoder.tokenizer, max_length=64, encoder=encoder), 2, pack=True)
    # a row cut by max_length is dropped, not cut (the cut could split its image's placeholders)
    with pytest.raises(DataError, match="no sample with a response token"):
        SFTDataset([row], encoder.tokenizer, max_length=8, encoder=encoder)


def test_sft_then_rl_on_image_prompts(tiny_vision_model_path, tmp_path):
    data = {split: write_rows(make_shapes_split(16, 0, split=split), tmp_path / f"{split}.parquet") for split in ("train", "test")}
    common = [f"data.train_path={data['train']}", f"data.val_path={data['test']}", "trainer.total_steps=2", "trainer.trackers=[jsonl]"]
    train(None, ["recipe=sft", f"model.path={tiny_vision_model_path}", "data.batch_samples=8", "data.max_length=64", "trainer.save_hf_model=true",
                 f"trainer.run_dir={tmp_path / 'sft'}", *common])  # fmt: skip
    saved = tmp_path / "sft" / "hf_model"
    assert type(AutoModelForImageTextToText.from_pretrained(saved)).__name__ == "Qwen2VLForConditionalGeneration"
    assert AutoImageProcessor.from_pretrained(saved).to_dict() == AutoImageProcessor.from_pretrained(tiny_vision_model_path).to_dict()
    sft = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(row["sft/loss"])) for row in sft if "sft/loss" in row)
    train(None, ["recipe=rl", f"model.path={saved}", "data.train_batch_prompts=4", "sampling.n=2", "sampling.max_new_tokens=4",
                 "reward.name=gsm8k", f"trainer.run_dir={tmp_path / 'rl'}", *common])  # fmt: skip
    rl = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [row["sync/batch_gap"] < 1e-4 for row in rl if "sync/batch_gap" in row] == [True, True]
