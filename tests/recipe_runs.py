"""Fixtures for end-to-end runs (the conftest of tests/integration and tests/judges imports them): arithmetic data files in
verl's schema and helpers to run recipes."""

from __future__ import annotations

import json

import pytest

from trellis.recipes.train import train
from trellis_demo.tasks import make_arithmetic_split, write_rows


@pytest.fixture(scope="session")
def data_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    return {
        "train": str(write_rows(make_arithmetic_split(64, 0, max_value=50), folder / "train.parquet")),
        "test": str(write_rows(make_arithmetic_split(8, 0, split="test", max_value=50), folder / "test.jsonl")),
    }


def _run_recipe(run_dir, base: list[str], overrides: tuple[str, ...]):
    """Train with ``base`` then ``overrides`` in ``run_dir``; returns (summary, metrics rows)."""
    summary = train(None, [*base, f"trainer.run_dir={run_dir}", *overrides])
    return summary, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def run_recipe():
    """``run_recipe(run_dir, base_overrides, overrides)``: a recipe run and its metrics rows."""
    return _run_recipe


@pytest.fixture
def run_rl(tiny_model_path, data_files, tmp_path):
    """``run_rl(*overrides, run_dir=...)`` runs a 2-step rl recipe on the tiny model; returns (summary, metrics rows)."""

    def run(*overrides: str, run_dir=None):
        base = [
            "recipe=rl",
            f"model.path={tiny_model_path}",
            f"data.train_path={data_files['train']}",
            f"data.val_path={data_files['test']}",
            "data.train_batch_prompts=4",
            "sampling.n=4",
            "sampling.max_new_tokens=6",
            "actor.micro_batch_samples=8",
            "actor.optim.lr=1e-3",
            "trainer.total_steps=2",
            "trainer.trackers=[jsonl]",
        ]
        return _run_recipe(run_dir or tmp_path / "rl", base, overrides)

    return run


@pytest.fixture
def step_batches(monkeypatch):
    """The list of every rl step's batch, as the advantage estimator gets it (scored, refilled), filled as the run goes."""
    import trellis_algos.rl.learner as learner

    seen, advantages = [], learner.compute_advantages

    def recording(batch, *args):
        seen.append(batch)
        return advantages(batch, *args)

    monkeypatch.setattr(learner, "compute_advantages", recording)
    return seen
