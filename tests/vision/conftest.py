"""Fixtures of the vision tests: a tiny Qwen2-VL built locally (random weights, trained tokenizer, image processor)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # images.py

QUESTIONS = ["how many squares?", "what color are the squares?", "red green blue", "1 2 3 4 5"]


@pytest.fixture(scope="session")
def tiny_vision_model_path(tmp_path_factory):
    from trellis_demo.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-vision", QUESTIONS, hidden_size=32, num_layers=2, seed=0, vision=True))


@pytest.fixture(scope="session")
def registry():
    from trellis.plugins import load_plugins

    return load_plugins().registry
