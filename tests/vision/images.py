"""Images for the vision tests, drawn here (nothing downloaded): colored squares on a plain background, as PNG bytes."""

from __future__ import annotations

import io

from PIL import Image, ImageDraw

COLORS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220)}


def squares(color: str, count: int, size: tuple[int, int] = (56, 56)) -> bytes:
    """PNG bytes: ``count`` squares of ``color`` in a row on white."""
    image = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    side = max(4, size[0] // (2 * count + 1))
    for k in range(count):
        x = side * (2 * k + 1)
        draw.rectangle([x, size[1] // 3, x + side - 1, size[1] // 3 + side - 1], fill=COLORS[color])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def image_row(question: str, images: list, answer: str, index: int = 0) -> dict:
    """A prompt row in verl's multimodal schema: ``<image>`` in the text, the images in ``images``."""
    return {
        "prompt": [{"role": "user", "content": question}],
        "images": [{"bytes": image} for image in images],
        "data_source": "shapes",
        "reward_model": {"ground_truth": answer},
        "extra_info": {"index": index},
    }
