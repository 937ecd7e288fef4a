"""Megatron tests: the CPU shim in this process and the spawned ranks (``cpu_shim``, test
scaffolding), and a tiny Llama folder beside the repo's tiny Qwen2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import cpu_shim  # noqa: E402

cpu_shim.install()


@pytest.fixture(scope="session")
def tiny_llama_path(tiny_untied_model_path, tmp_path_factory):
    """A random 2-layer Llama (untied head, no attention bias) with the tiny model's tokenizer."""
    import shutil

    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    qwen = AutoConfig.from_pretrained(tiny_untied_model_path)
    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    config = LlamaConfig(
        vocab_size=qwen.vocab_size,
        hidden_size=32,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=qwen.bos_token_id,
        eos_token_id=qwen.eos_token_id,
        pad_token_id=qwen.pad_token_id,
    )
    torch.manual_seed(3)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tiny_untied_model_path) / name).exists():
            shutil.copy(Path(tiny_untied_model_path) / name, out / name)
    return str(out)
