"""Image prompts in verl's multimodal schema: each image's placeholder expands to its merged patches,
the images reach the batch as the model's processor makes them, and bad rows stop naming the row."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch
from images import image_row, squares
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer
from trellis_vision.prompts import ImagePrompts

from trellis.config import ConfigError
from trellis.data import DataError, load_rows
from trellis.interfaces.backend import IMAGE_INPUTS
from trellis.interfaces.rollout import stop_ids
from trellis.registry import Registry
from trellis_algos import PromptDataset, prompt_images
from trellis_demo.tasks import write_rows


@pytest.fixture(scope="module")
def tokenizer(tiny_vision_model_path):
    return AutoTokenizer.from_pretrained(tiny_vision_model_path)


@pytest.fixture(scope="module")
def encoder(tiny_vision_model_path, tokenizer):
    return ImagePrompts(tiny_vision_model_path, tokenizer, SimpleNamespace(image_key="images"))


def rows():
    """Mixed widths: one 56x56 image (2x2 merged patches), two images of other sizes, no image."""
    return [
        image_row("<image>how many squares?", [squares("red", 2)], "2"),
        image_row("red <image> green <image>?", [squares("blue", 1, (112, 56)), squares("green", 3, (56, 84))], "4", 1),
        {**image_row("how many squares?", [], "1", 2), "images": None},
    ]


def test_each_placeholder_expands_to_its_images_merged_patches(tiny_vision_model_path, tokenizer, encoder):
    batch = PromptDataset(rows(), tokenizer, 256, encoder=encoder).as_batch()
    processor = AutoImageProcessor.from_pretrained(tiny_vision_model_path)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # 56x56 -> grid (1, 4, 4) -> 4 merged patches; 112x56 -> (1, 4, 8) -> 8; 56x84 -> (1, 6, 4) -> 6
    expected_grids = [[[1, 4, 4]], [[1, 4, 8], [1, 6, 4]], []]
    for row, grids in enumerate(expected_grids):
        inputs = batch[IMAGE_INPUTS][row]
        assert (inputs["image_grid_thw"].tolist() if inputs else []) == grids
        ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
        assert ids.count(pad) == sum(t * h * w // 4 for t, h, w in grids)
        if grids:
            # the pixels are the image processor's own, image after image
            images = [Image.open(io.BytesIO(image["bytes"])).convert("RGB") for image in rows()[row]["images"]]
            pixels = torch.cat([processor(images=[image], return_tensors="pt")["pixel_values"] for image in images])
            assert torch.equal(inputs["pixel_values"], pixels)
    # the text around the images is the chat template's, each placeholder at its image's place
    text = tokenizer.decode(batch["input_ids"][1][batch["attention_mask"][1].bool()])
    assert text == (
        "<|im_start|>user\nred <|vision_start|>" + "<|image_pad|>" * 8 + "<|vision_end|> green <|vision_start|>"
        + "<|image_pad|>" * 6 + "<|vision_end|>?<|im_end|>\n<|im_start|>assistant\n"
    )  # fmt: skip
    again = PromptDataset(rows(), tokenizer, 256, encoder=encoder).as_batch()
    assert all(torch.equal(a[k], b[k]) for a, b in zip(batch[IMAGE_INPUTS], again[IMAGE_INPUTS]) for k in a)


def test_images_read_back_from_parquet_and_resized_by_their_own_bounds(tmp_path, tokenizer, encoder):
    row = image_row("<image><image>?", [squares("red", 1, (112, 112)), squares("red", 1, (112, 112))], "1")
    row["images"][1]["max_pixels"] = 56 * 56  # verl's per-image bound
    path = write_rows([row], tmp_path / "rows.parquet")
    (read,) = load_rows(str(path))
    grids = PromptDataset([read], tokenizer, 256, encoder=encoder).as_batch()[IMAGE_INPUTS][0]["image_grid_thw"]
    assert grids.tolist() == [[1, 8, 8], [1, 4, 4]]


def test_jsonl_rows_name_their_images_by_path(tmp_path, tokenizer, encoder):
    """verl's JSONL rows: an image file's path (or ``file://`` URL, or ``{"image": path}``) per ``<image>``."""
    paths = [tmp_path / "a.png", tmp_path / "b.png"]
    for path, count in zip(paths, (1, 3)):
        path.write_bytes(squares("red", count, (112, 56)))
    row = {**image_row("<image> then <image>", [], "4"), "images": [str(paths[0]), {"image": f"file://{paths[1]}"}]}
    (read,) = load_rows(str(write_rows([row], tmp_path / "rows.jsonl")))
    inputs = PromptDataset([read], tokenizer, 256, encoder=encoder).as_batch()[IMAGE_INPUTS][0]
    from_bytes = PromptDataset([image_row("<image> then <image>", [p.read_bytes() for p in paths], "4")], tokenizer, 256, encoder=encoder)
    assert torch.equal(inputs["pixel_values"], from_bytes.as_batch()[IMAGE_INPUTS][0]["pixel_values"])


@pytest.mark.parametrize(
    ("images", "message"),
    [
        ([], "its messages place 1 <image> but column 'images' holds 0 images"),
        ([b"not an image"], "row 1 column 'images' image 0 is not an image Pillow can read"),
        (["https://example.com/a.png"], "row 1 column 'images' image 0 is a URL"),
        (["/no/such/image.png"], "row 1 column 'images' image 0: no image file '/no/such/image.png'"),
        ([{"path": None}], "row 1 column 'images' image 0 is a dict without 'bytes', 'image' or 'path'"),
        ([3], "row 1 column 'images' image 0 is a int"),
    ],
)
def test_a_bad_row_is_refused_naming_it(tokenizer, encoder, images, message):
    bad = {**image_row("<image>how many?", [], "1", 1), "images": images}
    with pytest.raises(DataError, match=message.replace("?", r"\?").replace("(", r"\(")):
        PromptDataset([rows()[0], bad], tokenizer, 256, encoder=encoder)


def test_a_text_model_refuses_rows_with_images(tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    with pytest.raises(DataError, match="row 0 holds images in column 'images', but the model takes text only"):
        PromptDataset(rows()[:1], tokenizer, 256)
    assert len(PromptDataset(rows()[2:], tokenizer, 256)) == 1  # a null image column is no image


def test_recipes_pick_the_encoder_by_the_model_and_name_the_package_when_missing(tiny_vision_model_path, tiny_model_path, tokenizer, registry):
    data = SimpleNamespace(image_key="images")
    assert isinstance(prompt_images(tiny_vision_model_path, data, registry, tokenizer), ImagePrompts)
    with pytest.raises(ConfigError, match="is a vision-language model; reading its image prompts: prompt_encoder 'images' is not installed"):
        prompt_images(tiny_vision_model_path, data, Registry(), tokenizer)
    assert prompt_images(tiny_model_path, data, registry, tokenizer) is None


def test_a_vision_models_placeholders_end_a_response(tiny_vision_model_path, tokenizer):
    placeholders = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    assert set(placeholders) <= stop_ids(tiny_vision_model_path, tokenizer)
