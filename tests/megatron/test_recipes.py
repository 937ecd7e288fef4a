"""The ``rl`` recipe (actor and GAE critic) on the Megatron backend at TP=2 on 2 CPU ranks under the Ray controller: a run
killed (SIGKILL) after its step-2 checkpoint and relaunched logs the metrics of an uninterrupted
run; ``trellis export`` of its checkpoint (one process: TP=1) gives the weights the run itself
exported."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ranks import boot_env
from safetensors.torch import load_file

from trellis.export import export_checkpoint
from trellis_demo.tasks import make_arithmetic_split, write_rows

HERE = Path(__file__).parent
KILLABLE = HERE.parent / "integration" / "killable.py"
TRAIN = "import sys; from trellis.recipes.train import train; train(None, sys.argv[1:])"


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def overrides(tiny_model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    train_file = write_rows(make_arithmetic_split(8, 0, max_value=50), folder / "train.parquet")
    return [
        "recipe=rl",
        f"model.path={tiny_model_path}",
        f"data.train_path={train_file}",
        "data.train_batch_prompts=4",
        "sampling.n=4",
        "sampling.max_new_tokens=6",
        "actor.micro_batch_samples=8",
        "actor.shuffle=true",
        "actor.optim.lr=1e-3",
        "actor.optim.lr_schedule=cosine",
        "actor.optim.warmup_steps=1",
        "algorithm.advantage.name=gae",  # a critic (on Megatron too): advantages are not all zero
        "critic.micro_batch_samples=8",
        "trainer.total_steps=4",
        "trainer.save_every_steps=2",
        "trainer.save_hf_model=true",
        "trainer.trackers=[jsonl]",
        "trainer.threads=1",
        "trainer.controller=ray",
        "trainer.procs_per_node=2",
        "backend.name=megatron",
        "backend.tensor_parallel=2",
    ]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=boot_env(), capture_output=True, text=True, timeout=900)


def test_killed_run_resumes_to_the_metrics_of_an_uninterrupted_run_and_exports(overrides, tmp_path):
    reference = tmp_path / "reference"
    done = run(["-c", TRAIN, *overrides, f"trainer.run_dir={reference}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    want = rows(reference)
    assert [r["step"] for r in want] == [1, 2, 3, 4]

    resumed = tmp_path / "resumed"
    killed = run([str(KILLABLE), "saved", "2", *overrides, f"trainer.run_dir={resumed}"], tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [r["step"] for r in rows(resumed)] == [1, 2]
    again = run(["-c", TRAIN, *overrides, f"trainer.run_dir={resumed}"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]

    got = rows(resumed)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want):
        keys = {k for k in w if not k.startswith(("timing/", "dispatch/"))}
        assert keys == {k for k in g if not k.startswith(("timing/", "dispatch/"))}
        for k in keys:
            assert g[k] == pytest.approx(w[k], abs=1e-6, rel=0), f"step {w['step']}: {k}"
    assert all(r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0 for r in want)  # both roles trained

    out = export_checkpoint(resumed, tmp_path / "exported")
    exported, by_run = load_file(out / "model.safetensors"), load_file(resumed / "hf_model" / "model.safetensors")
    assert set(exported) == set(by_run)
    for name, tensor in by_run.items():
        assert torch.equal(exported[name], tensor), name
