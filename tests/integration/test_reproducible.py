"""Reproducible runs: every run folder records what its figures depend on besides the config
(versions, CPU, torch threads), and ``trainer.threads=auto`` keeps one thread count for a run and
its resumes, so a resumed run equals an uninterrupted one whatever the load when it resumed."""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path

import pytest
import torch
import transformers

from trellis.recipes.train import train
from trellis.runtime import provenance
from trellis.runtime import threads as threads_mod
from trellis.runtime.checkpoint import read_manifest
from trellis_demo.demo import stage_provenance

LOCK = Path(__file__).parents[2] / "locks" / "project.txt"


def test_the_installed_libraries_are_the_locked_ones():
    """nox installs every session of the project under locks/project.txt, so the versions a run
    records are the lock's: the ones the README's figures were measured with."""
    pins = dict(line.strip().split("==") for line in LOCK.read_text().splitlines() if "==" in line)
    found = provenance.versions()
    for name in ("torch", "transformers", "tokenizers", "numpy", "safetensors"):
        assert found[name].split("+")[0] == pins[name], (
            f"{name} {found[name]} is installed, locks/project.txt pins {pins[name]}: install through nox (pip install -c "
            "locks/project.txt ...), or run nox -s lock when the lock is what should move"
        )


@pytest.fixture
def sft(tiny_model_path, data_files):
    """``sft(run_dir, total_steps, threads)``: the sft recipe, 2 steps an epoch over 64 rows, a checkpoint every 2 steps."""

    def run(run_dir: Path, total_steps: int, threads: str) -> list[dict]:
        train(None, [
            "recipe=sft", f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}", "data.batch_samples=32",
            "train.optim.lr=1e-2", "trainer.trackers=[jsonl]", f"trainer.threads={threads}", "trainer.save_every_steps=2",
            f"trainer.total_steps={total_steps}", f"trainer.run_dir={run_dir}",
        ])  # fmt: skip
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    return run


def test_a_run_folder_records_versions_cpu_and_threads(sft, tmp_path):
    sft(tmp_path / "run", 2, "1")
    found = provenance.read(tmp_path / "run")
    assert found["versions"]["torch"] == torch.__version__
    assert found["versions"]["transformers"] == transformers.__version__
    assert found["versions"]["tokenizers"] == metadata.version("tokenizers")
    assert found["versions"]["trellis-core"] == metadata.version("trellis-core")
    assert found["cpu"]["model"] and found["cpu"]["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert found["torch_threads"] == 1
    assert read_manifest(tmp_path / "run" / "checkpoint-2")["torch_threads"] == 1


@pytest.mark.skipif(threads_mod.usable_cores() < 2 or not os.path.isfile("/proc/stat"), reason="needs 2 cores and /proc")
def test_a_resumed_auto_run_keeps_its_thread_count_and_equals_an_uninterrupted_one(sft, tmp_path, monkeypatch):
    """Both runs start on a quiet machine (``auto`` takes every core); when the stopped one resumes,
    a neighbour keeps all cores but one busy, so ``auto`` measuring afresh would take 1 thread."""
    cores = threads_mod.usable_cores()
    monkeypatch.setattr(threads_mod, "others_busy", lambda before, after: 0.0)
    straight = sft(tmp_path / "straight", 4, "auto")
    sft(tmp_path / "stopped", 2, "auto")
    monkeypatch.setattr(threads_mod, "others_busy", lambda before, after: cores - 1.0)
    resumed = sft(tmp_path / "stopped", 4, "auto")

    assert [r["timing/threads"] for r in resumed] == [cores] * 4
    assert read_manifest(tmp_path / "stopped" / "checkpoint-4")["torch_threads"] == cores
    assert provenance.read(tmp_path / "stopped")["torch_threads"] == cores
    figures = [[(k, v) for k, v in r.items() if not k.startswith("timing/")] for r in resumed]
    assert figures == [[(k, v) for k, v in r.items() if not k.startswith("timing/")] for r in straight]  # bit for bit

    # a fresh auto run started beside that neighbour takes 1 thread; the demo's summary names each stage's count
    sft(tmp_path / "busy", 2, "auto")
    summary = stage_provenance(tmp_path / "busy", tmp_path / "straight")
    assert summary["torch_threads"] == {"sft": 1, "rl": cores} and summary["versions"]["torch"] == torch.__version__
