"""HF <-> Megatron-Core on the tiny models: the Megatron model's logits equal Hugging Face's at
TP=1 and TP=2 over gloo (Qwen2 tied and untied, Llama), and exported weights round-trip exactly."""

from __future__ import annotations

from itertools import chain

import pytest
import torch
from ranks import run_ranks
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trellis.interfaces.dispatch import Mesh
from trellis.plugins import load_plugins
from trellis.runtime.worker import build_worker
from trellis_megatron.backend import _mask, _positions
from trellis_megatron.options import MegatronOptions


def left_padded(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return ids, mask


def _logits_and_export(info, path: str, tp: int):
    """This rank's full-vocabulary logits (TP shards gathered by the test) and exported weights."""
    registry = load_plugins().registry
    worker = build_worker(registry, "megatron", "ref", path, options=MegatronOptions(tensor_parallel=tp), dist=info)
    backend = worker.backend
    ids, mask = left_padded(backend.hf_config.vocab_size)
    with torch.no_grad():
        local = backend.model(ids, _positions(ids), _mask(mask))
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=torch.distributed.group.WORLD)
    logits = torch.cat(parts, -1)[..., : backend.hf_config.vocab_size]
    weights = dict(chain.from_iterable(worker.export_weights(bucket_bytes=4096, all_ranks=True)))
    buckets = sum(1 for _ in worker.export_weights(bucket_bytes=4096))
    bf16 = list(chain.from_iterable(worker.export_weights(all_ranks=True, dtype=torch.bfloat16)))
    shapes = worker.weight_shapes()
    return {"logits": logits, "weights": weights, "buckets": buckets, "local_vocab": local.shape[-1], "bf16": bf16, "shapes": shapes}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", ["tiny_model_path", "tiny_untied_model_path", "tiny_llama_path"])
def test_logits_equal_hf_and_export_round_trips(model, tp, request):
    path = request.getfixturevalue(model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, mask = left_padded(hf.config.vocab_size)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    results = run_ranks(_logits_and_export, Mesh(tp=tp), path, tp)
    saved = load_file(f"{path}/model.safetensors")
    for r in results:
        # every rank holds only its share of the (padded) vocabulary
        assert r["local_vocab"] == -(-hf.config.vocab_size // tp)
        attended = mask.bool()
        torch.testing.assert_close(r["logits"][attended], want[attended], atol=1e-5, rtol=0)
        assert set(r["weights"]) == set(saved)
        for name, tensor in saved.items():
            assert torch.equal(r["weights"][name], tensor), name
        # the manifest: every exported name with its full shape, in export order, before any gather
        assert list(r["shapes"].items()) == [(name, tuple(tensor.shape)) for name, tensor in r["weights"].items()]
        assert all(t.dtype == torch.bfloat16 and torch.equal(t, saved[name].bfloat16()) for name, t in r["bf16"])
    assert results[0]["buckets"] > 1  # 4 KiB buckets: the export is streamed in pieces
    assert all(r["buckets"] == 0 for r in results[1:])  # without all_ranks only rank 0 receives
