"""What a Hugging Face model folder says of its model before anything is built: its ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path


def model_config(model_path: str | Path) -> dict:
    """A Hugging Face folder's ``config.json``; empty when the folder has none."""
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def text_config(model_path: str | Path) -> dict:
    """A Hugging Face folder's ``config.json`` (its ``text_config`` for a multimodal model); empty
    when the folder has none."""
    config = model_config(model_path)
    return config.get("text_config", config) if "hidden_size" not in config else config
