"""The ``images`` prompt encoder: verl's multimodal rows (an image column, ``<image>`` in the prompt's
text) rendered and tokenized for a Qwen2-VL-family model, each image's placeholder expanded to its
merged patches, and the images processed again for each batch (not held as tensors between)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from transformers import AutoConfig, AutoImageProcessor

from trellis import DataError, encode_text, render_chat

PLACEHOLDER = "<image>"  # where verl's rows put an image in a message's text
SIZE_KEYS = ("min_pixels", "max_pixels")  # verl's per-image bounds, in a dict beside the image


class ImagePrompts:
    """Prompts with images for the model at ``model_path`` (its image processor, its image token).

    A row's images (column ``data.image_key``) are, one per ``<image>`` in its messages' text, in
    order: image bytes, a file path (``file://`` too), a PIL image, or a dict as verl and Hugging
    Face datasets write them: ``{"bytes": ...}``, ``{"path": ...}`` or ``{"image": ...}``, with
    optional ``min_pixels``/``max_pixels`` bounding that image's resize (else the processor's)."""

    def __init__(self, model_path: str, tokenizer: Any, data: Any) -> None:
        self.tokenizer = tokenizer
        self.processor = AutoImageProcessor.from_pretrained(model_path)
        config = AutoConfig.from_pretrained(model_path)
        self.image_token = tokenizer.convert_ids_to_tokens(config.image_token_id)
        self.image_token_id = config.image_token_id
        self.merge = self.processor.merge_size
        self.image_key = data.image_key

    def encode(
        self, messages: list[dict[str, Any]], row: dict[str, Any], where: str, template_kwargs: dict[str, Any]
    ) -> tuple[list[int], list[tuple[Any, dict]]]:
        """Token ids of the prompt rendered by the chat template (given ``template_kwargs``), the image
        token repeated once per merged patch of each image, and the row's images (sources and sizes)
        for :meth:`model_inputs`."""
        images = [_source(image, f"{where} column {self.image_key!r} image {k}") for k, image in enumerate(_listed(row.get(self.image_key)))]
        parts = [{**m, "content": _parts(m["content"])} for m in messages]
        placed = sum(isinstance(m["content"], list) and sum(p["type"] == "image" for p in m["content"]) for m in parts)
        if placed != len(images):
            raise DataError(
                f"{where}: its messages place {placed} {PLACEHOLDER} but column {self.image_key!r} holds {len(images)} images; "
                f"put one {PLACEHOLDER} in the prompt's text where each image goes, in order"
            )
        # the token counts from the images' sizes alone: the pixels are processed for each batch, not twice
        counts = [self._slots(source, size, f"{where} column {self.image_key!r} image {k}") for k, (source, size) in enumerate(images)]
        return self._tokens(render_chat(self.tokenizer, parts, True, template_kwargs), counts, where), images

    def encode_turn(self, text: str, images: list[Any], where: str) -> tuple[list[int], dict[str, torch.Tensor]]:
        """An environment turn (a tool's result) rendered as ``text``, one placeholder per image: its
        token ids with each placeholder expanded, and the images' ``pixel_values`` / ``image_grid_thw``."""
        processed = [self._processed(*_source(image, f"{where} image {k}"), f"{where} image {k}") for k, image in enumerate(images)]
        counts = [int(p["image_grid_thw"][0].prod()) // self.merge**2 for p in processed]
        return self._tokens(text, counts, where), _joined(processed)

    def model_inputs(self, kept: list[tuple[Any, dict]]) -> dict[str, torch.Tensor]:
        """The sample's ``pixel_values`` ``(patches, channels x temporal x patch x patch)`` and
        ``image_grid_thw`` ``(images, 3)``, its images in order; empty without one."""
        return _joined([self._processed(source, size, "an image") for source, size in kept])

    def _tokens(self, text: str, counts: list[int], where: str) -> list[int]:
        """``text``'s token ids, its image tokens repeated ``counts`` times (each image's merged patches), in order."""
        pieces = text.split(self.image_token)
        if len(pieces) != len(counts) + 1:
            raise DataError(f"{where}: the chat template rendered {len(pieces) - 1} image tokens {self.image_token!r} for {len(counts)} images")
        ids = encode_text(self.tokenizer, pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:])))
        if ids.count(self.image_token_id) != sum(counts):
            raise DataError(f"{where}: the tokenizer split the image token {self.image_token!r}; it must be one special token")
        return ids

    def _slots(self, source: Any, size: dict[str, int], where: str) -> int:
        """How many image tokens the image takes: its merged patches at the size the processor resizes
        it to (decoded, so an unreadable image is refused now, naming ``where``)."""
        image = _opened(source, where)
        edges = self._edges(size)
        bounds = {"min_pixels": edges["shortest_edge"], "max_pixels": edges["longest_edge"]}
        try:
            return self.processor.get_number_of_image_patches(image.height, image.width, bounds) // self.merge**2
        except ValueError as exc:
            raise DataError(f"{where} ({image.width}x{image.height}): the image processor refused it: {exc}") from None

    def _processed(self, source: Any, size: dict[str, int], where: str) -> dict[str, torch.Tensor]:
        image = _opened(source, where)
        try:
            return self.processor(images=[image], return_tensors="pt", **({"size": self._edges(size)} if size else {}))
        except ValueError as exc:
            raise DataError(f"{where} ({image.width}x{image.height}): the image processor refused it: {exc}") from None

    def _edges(self, size: dict[str, int]) -> dict[str, int]:
        """An image's pixel bounds (``shortest_edge``, ``longest_edge``): its own where given, else the processor's."""
        return {edge: size.get(edge, self.processor.size[edge]) for edge in ("shortest_edge", "longest_edge")}


def _joined(processed: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Processed images as one ``IMAGE_INPUTS`` dict (empty for none)."""
    return {name: torch.cat([p[name] for p in processed]) for name in ("pixel_values", "image_grid_thw")} if processed else {}


def _listed(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) or hasattr(value, "tolist") else [value]


def _parts(content: Any) -> Any:
    """A message's text with ``<image>`` as verl's dataset splits it: image and text parts in order."""
    if not isinstance(content, str) or PLACEHOLDER not in content:
        return content
    parts: list[dict[str, Any]] = []
    for k, text in enumerate(content.split(PLACEHOLDER)):
        if k:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def _source(image: Any, where: str) -> tuple[Any, dict[str, int]]:
    """An image's source (bytes, a path or a PIL image) and its resize bounds as the processor's ``size``."""
    size: dict[str, int] = {}
    if isinstance(image, dict):
        bounds = {k: image[k] for k in SIZE_KEYS if image.get(k) is not None}
        if bounds:
            size = {"shortest_edge": int(bounds.get("min_pixels", 0)) or None, "longest_edge": int(bounds.get("max_pixels", 0)) or None}
            size = {k: v for k, v in size.items() if v}
        image = next((image[k] for k in ("bytes", "image", "path") if image.get(k) is not None), None)
        if image is None:
            raise DataError(f"{where} is a dict without 'bytes', 'image' or 'path'; give the image in one of them")
    if isinstance(image, str):
        if image.startswith(("http://", "https://")):
            raise DataError(f"{where} is a URL ({image:.80}); nothing is downloaded during a run: save the image and give its path")
        image = image.removeprefix("file://")
        if not Path(image).is_file():
            raise DataError(f"{where}: no image file {image!r}")
    elif not isinstance(image, (bytes, bytearray, Image.Image)):
        raise DataError(f"{where} is a {type(image).__name__}; give image bytes, a path, a PIL image or a dict with one of them")
    return image, size


def _opened(source: Any, where: str) -> Image.Image:
    """The image as RGB."""
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"{where} is not an image Pillow can read: {exc}") from None
