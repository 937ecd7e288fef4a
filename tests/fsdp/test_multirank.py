"""The FSDP backend on 2 gloo ranks where memory and collectives matter: the weight export
streams one tensor at a time (peak memory measured), the model is read from the folder by rank 0
alone, and token-budget micro-batching with different response lengths per rank stays in step
and trains like one rank."""

from __future__ import annotations

import gc
import shutil
from itertools import chain
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from test_fsdp_worker import OBJECTIVES, RESPONSE, SAMPLES, actor_options, end_rank, free_port, make_worker, rl_batch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from trellis.batch import Batch
from trellis.interfaces.backend import DistInfo
from trellis.plugins import load_plugins


# -- weight sync memory ---------------------------------------------------------------------------
def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_rss_above_now(run) -> int:
    """Bytes the process's resident set grew to above its current size while ``run()`` ran.

    The peak is the kernel's high-water mark (``VmHWM``), reset first through
    ``/proc/self/clear_refs``; ``MALLOC_MMAP_THRESHOLD_`` (set before the rank started) makes
    glibc map every tensor-sized block on its own and unmap it when freed, so what the resident
    set holds at its peak is what was alive then, not a heap that never shrinks."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_kib("VmRSS")
    run()
    return (_rss_kib("VmHWM") - before) * 1024


def _sync_main(rank: int, world: int, port: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    registry = load_plugins().registry
    worker = make_worker(registry, path, "ref", dist=DistInfo(rank, world, master_port=port))
    backend = worker.backend
    shard = sum(p.to_local().numel() * p.element_size() for p in backend.params)
    largest = max(p.numel() * p.element_size() for p in backend.params)
    shapes = worker.weight_shapes()
    received: dict[str, tuple] = {}

    def stream():  # what an engine does: take each bucket, load it, let it go
        for bucket in worker.export_weights(bucket_bytes=1 << 20, all_ranks=True, dtype=torch.bfloat16):
            received.update((name, (tuple(t.shape), t.dtype)) for name, t in bucket)
            del bucket

    def whole():  # the export before: every rank gathers the full state dict first
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(backend.model, options=StateDictOptions(full_state_dict=True))
        del state

    streamed = _peak_rss_above_now(stream)
    gathered = _peak_rss_above_now(whole)
    result = {"shard": shard, "largest": largest, "streamed": streamed, "gathered": gathered, "shapes": shapes, "received": received}
    torch.save(result, f"{out}/rank{rank}.pt")
    end_rank()


@pytest.fixture(scope="module")
def model_50m(tmp_path_factory) -> str:
    """A ~50M-parameter Qwen2 folder (random weights, tied embeddings; no tokenizer needed)."""
    config = Qwen2Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=14, num_attention_heads=8, num_key_value_heads=2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("models") / "qwen2-50m"
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def test_weight_sync_peak_memory_stays_below_one_tensor_above_the_shard(model_50m, tmp_path, monkeypatch):
    """2 ranks export a 50M model cast to bf16 in 1 MiB buckets, as an engine consumes them. The
    resident set grows above the shard by less than the largest tensor (fp32 bytes): one gathered
    bf16 tensor plus a bucket. The full-state-dict gather the export used to do, measured the same
    way, grows by about the whole model (the measure sees the difference)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 << 10))
    mp.start_processes(_sync_main, args=(2, free_port(), model_50m, str(tmp_path)), nprocs=2, start_method="spawn")
    model = AutoModelForCausalLM.from_pretrained(model_50m, dtype=torch.float32)
    total = sum(p.numel() * 4 for p in model.parameters())
    assert 45e6 * 4 < total < 55e6 * 4
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["shard"] == pytest.approx(total / 2, rel=0.01)
        assert r["streamed"] < r["largest"], (rank, r["streamed"], r["largest"])
        assert r["gathered"] > 0.8 * total, (rank, r["gathered"], total)  # the old way holds the whole model
        # names and shapes announced before the stream (from the shards) are what came, in bf16
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        assert r["shapes"] == expected
        assert {k: s for k, (s, _) in r["received"].items()} == expected
        assert {d for _, d in r["received"].values()} == {torch.bfloat16}


# -- rank 0 reads the folder ---------------------------------------------------------------------------
def _build_main(rank: int, world: int, port: int, paths: list[str], out: str) -> None:
    torch.set_num_threads(1)
    registry = load_plugins().registry
    worker = make_worker(registry, paths[rank], "actor", actor_options(registry), OBJECTIVES["actor"], DistInfo(rank, world, master_port=port))
    weights = dict(chain.from_iterable(worker.export_weights(all_ranks=True)))
    buffers = {k: v for k, v in worker.backend.model.named_buffers()}
    torch.save({"weights": weights, "buffers": buffers}, f"{out}/rank{rank}.pt")
    end_rank()


def test_model_build_reads_the_folder_on_rank_0_only(tiny_model_path, tmp_path):
    """Rank 1 is given a copy of the folder without its weight files: it builds from config.json
    alone, and both ranks hold the folder's weights and the rotary buffers a fresh load computes."""
    config_only = tmp_path / "config-only"
    shutil.copytree(tiny_model_path, config_only)
    for f in config_only.glob("*.safetensors"):
        f.unlink()
    mp.start_processes(_build_main, args=(2, free_port(), [tiny_model_path, str(config_only)], str(tmp_path)), nprocs=2, start_method="spawn")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    buffers = dict(model.named_buffers())
    assert any(k.endswith("inv_freq") for k in buffers)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, tensor in model.state_dict().items():
            assert torch.equal(got["weights"][name], tensor), (rank, name)
        for name, tensor in buffers.items():
            assert torch.equal(got["buffers"][name], tensor), (rank, name)


# -- token budget with uneven ranks ------------------------------------------------------------------
def uneven_batch(vocab: int) -> Batch:
    """8 samples whose even rows (rank 0's share when dealt over 2 ranks) have full-length responses
    and odd rows (rank 1's) 1-token ones, so a token budget cuts rank 0's share into more micro-batches."""
    return rl_batch(vocab, seed=3, response_lengths=torch.tensor([RESPONSE if i % 2 == 0 else 1 for i in range(SAMPLES)]), temperature=1.0)


def _budget_main(rank: int, world: int, port: int, path: str, batch: Batch, out: str) -> None:
    torch.set_num_threads(1)
    registry = load_plugins().registry
    opts = actor_options(registry, max_tokens_per_micro_batch=24)
    worker = make_worker(registry, path, "actor", opts, OBJECTIVES["actor"], DistInfo(rank, world, master_port=port))
    share = batch[torch.arange(rank, len(batch), world)]  # the strided deal of the controllers
    log_probs = worker.log_prob(share)["log_probs"]
    share["old_log_probs"] = log_probs
    metrics = worker.train("update", share)
    micros = len(worker.plan.micro_batches(share))
    weights = dict(chain.from_iterable(worker.export_weights()))
    torch.save({"metrics": metrics, "weights": weights, "log_probs": log_probs, "micros": micros}, f"{out}/rank{rank}.pt")
    if world > 1:  # one rank runs in the test's own process
        end_rank()


def test_token_budget_with_different_lengths_per_rank_trains_like_one_rank(tiny_model_path, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    batch = uneven_batch(model.config.vocab_size)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    _budget_main(0, 1, 0, tiny_model_path, batch, str(tmp_path / "one"))
    mp.start_processes(_budget_main, args=(2, free_port(), tiny_model_path, batch, str(tmp_path / "two")), nprocs=2, start_method="spawn")
    one = torch.load(tmp_path / "one" / "rank0.pt")
    ranks = [torch.load(tmp_path / "two" / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["micros"] > ranks[1]["micros"], "the ranks must cut different numbers of micro-batches"
    for r, got in enumerate(ranks):
        torch.testing.assert_close(got["log_probs"], one["log_probs"][r::2], atol=1e-6, rtol=0)
    assert ranks[0]["metrics"]["actor/pg_loss"] == pytest.approx(one["metrics"]["actor/pg_loss"], abs=1e-6)
    assert ranks[0]["metrics"]["actor/grad_norm"] == pytest.approx(one["metrics"]["actor/grad_norm"], rel=1e-5)
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][name], tensor, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


# -- leaving the process group -------------------------------------------------------------------------
LEAVES_AT_EXIT = """
import atexit, sys
import torch.distributed as dist
atexit.register(lambda: print("in group at exit:", dist.is_initialized()))  # runs after the backend's hook (LIFO)
from trellis.plugins import load_plugins
from trellis.runtime.worker import build_worker
build_worker(load_plugins().registry, "fsdp", "ref", sys.argv[1])
print("in group after build:", dist.is_initialized())
"""


def test_a_rank_leaves_its_process_group_at_close_or_else_at_exit(tiny_model_path, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text(LEAVES_AT_EXIT)
    out = subprocess.run([sys.executable, str(script), tiny_model_path], capture_output=True, text=True, timeout=300, check=True).stdout
    assert "in group after build: True" in out and "in group at exit: False" in out, out
    close = tmp_path / "close.py"
    close.write_text(LEAVES_AT_EXIT.replace("build_worker(", "worker = build_worker(") + "worker.close()\nprint('closed:', dist.is_initialized())\n")
    out = subprocess.run([sys.executable, str(close), tiny_model_path], capture_output=True, text=True, timeout=300, check=True).stdout
    assert "closed: False" in out, out
