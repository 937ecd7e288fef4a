"""What ``pip install ./packages/core ./packages/algos ./packages/backend-fsdp ./packages/rollout-hf``
gives (this session installs those and trellis-demo, for the tiny models, and nothing else): the
rl, sft and spin recipes train, and what another package brings stops before any model is built
with one line that names it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from trellis.config import ConfigError

MINIMAL = {"trellis-core", "trellis-algos", "trellis-backend-fsdp", "trellis-rollout-hf", "trellis-demo"}


def test_only_the_minimal_packages_are_installed():
    names = {d.metadata["Name"] for d in importlib.metadata.distributions()}
    assert {n for n in names if n.startswith("trellis")} == MINIMAL


def test_rl_trains(run_rl):
    _, rows = run_rl()
    assert len([r for r in rows if "actor/pg_loss" in r]) == 2


@pytest.mark.parametrize(
    ("recipe", "overrides", "metric"),
    [
        ("sft", ["data.batch_samples=8"], "sft/loss"),
        ("spin", ["data.train_batch_prompts=4", "sampling.n=2", "sampling.max_new_tokens=4"], "spin/pairs"),
    ],
)
def test_sft_and_spin_train(run_recipe, tiny_model_path, data_files, tmp_path, recipe, overrides, metric):
    base = [f"recipe={recipe}", f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}", "trainer.total_steps=2"]
    _, rows = run_recipe(tmp_path / recipe, [*base, "trainer.trackers=[jsonl]"], tuple(overrides))
    assert len([r for r in rows if metric in r]) == 2, rows


@pytest.mark.parametrize(
    ("override", "package"),
    [
        ("multi_turn.enable=true", "trellis-multiturn"),
        ("reward.name=judge", "trellis-judges"),
        ("reward.judge.engine=hf", "trellis-judges"),
        ("reward.model.path=rm", "trellis-judges"),
        ("trainer.controller=ray", "trellis-ray"),
        ("trainer.trackers=[wandb]", "trellis-trackers"),
    ],
)
def test_what_another_package_brings_is_refused_in_one_line_naming_it(run_rl, tmp_path, override, package):
    with pytest.raises(ConfigError) as err:
        run_rl(override, run_dir=tmp_path / "refused")
    message = str(err.value)
    assert f"pip install {package}" in message and "\n" not in message, message
    assert not (tmp_path / "refused").exists()


def test_a_command_another_package_brings_names_it(tmp_path):
    done = subprocess.run([sys.executable, "-m", "trellis.cli", "config", "from-verl", "x=1"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith("pip install trellis-verl-compat"), done.stderr
