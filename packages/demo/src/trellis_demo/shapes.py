"""A visual task with checkable answers, in verl's multimodal schema: count the colored squares of a
generated image (the vision demo and tests; nothing downloaded).

An image is a 3 x 2 grid of 28-pixel cells (84 x 56 pixels: one merged 2 x 2 patch of the tiny
vision model per cell, so one image token), 1 to ``max_count`` of them holding a red, green or blue
square on white. A row reads::

    {"data_source": "shapes", "prompt": [{"role": "user", "content": "<image>How many squares?"}],
     "images": [{"bytes": b"\\x89PNG..."}], "ability": "vision", "reward_model": {"style": "rule", "ground_truth": "3"},
     "extra_info": {"split": "train", "index": 0, "answer": "#### 3", "noisy": False}}

so verl's GSM8K rule (reward ``gsm8k``) scores the ``#### 3`` answers. An image is in the test split
when a hash of its layout falls in the lowest ``test_fraction``, so the splits never share one.
"""

from __future__ import annotations

import hashlib
import io
import random
from typing import Any

COLUMNS, ROWS, CELL = 3, 2, 28
COLORS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220)}
QUESTION = "<image>How many squares?"


def make_shapes_split(
    n: int, seed: int, *, split: str = "train", max_count: int = COLUMNS * ROWS, noisy_answer: float = 0.0, test_fraction: float = 0.2
) -> list[dict[str, Any]]:
    """``n`` rows of square-counting questions, deterministic by ``seed``; ``noisy_answer``: the
    probability that a row's taught answer (``extra_info.answer``) is another count (its
    ``ground_truth`` stays right), as the arithmetic task's, so an SFT model samples a mixture RL can sharpen."""
    if split not in ("train", "test"):
        raise ValueError(f"make_shapes_split: split={split!r}; use 'train' or 'test'")
    if not 1 < max_count <= COLUMNS * ROWS:
        raise ValueError(f"make_shapes_split: max_count={max_count} must be in 2..{COLUMNS * ROWS}")
    rng = random.Random(f"shapes:{split}:{seed}")
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        count = rng.randint(1, max_count)
        layout = tuple(sorted((cell, rng.choice(sorted(COLORS))) for cell in rng.sample(range(COLUMNS * ROWS), count)))
        if _in_test(layout, test_fraction) != (split == "test"):
            continue
        taught, noisy = count, False
        if noisy_answer > 0 and rng.random() < noisy_answer:
            taught, noisy = rng.choice([k for k in range(1, max_count + 1) if k != count]), True
        rows.append(
            {
                "data_source": "shapes",
                "prompt": [{"role": "user", "content": QUESTION}],
                "images": [{"bytes": draw(layout)}],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": str(count)},
                "extra_info": {"split": split, "index": len(rows), "answer": f"#### {taught}", "noisy": noisy},
            }
        )
    return rows


def shape_texts() -> list[str]:
    """Text to train the tiny vision model's tokenizer on: the question and every answer."""
    return [QUESTION.replace("<image>", ""), *(f"#### {k}" for k in range(COLUMNS * ROWS + 1)), "0123456789 ####"]


def draw(layout: tuple[tuple[int, str], ...]) -> bytes:
    """PNG bytes of a layout: ``(cell, color)`` pairs, cells numbered row by row."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (COLUMNS * CELL, ROWS * CELL), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for cell, color in layout:
        x, y = (cell % COLUMNS) * CELL, (cell // COLUMNS) * CELL
        pen.rectangle([x + 3, y + 3, x + CELL - 4, y + CELL - 4], fill=COLORS[color])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _in_test(layout: tuple[tuple[int, str], ...], test_fraction: float) -> bool:
    digest = hashlib.sha256(repr(layout).encode()).digest()
    return int.from_bytes(digest[:8], "big") < test_fraction * 2**64
