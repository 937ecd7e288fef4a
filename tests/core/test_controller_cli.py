"""Local controller routing, and the ``trellis`` CLI end to end on the example plugin's recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from cli_runs import run_cli as run_in_process
from omegaconf import OmegaConf

from trellis import cli
from trellis.batch import Batch
from trellis.plugins import load_plugins
from trellis.runtime.controller import LocalController
from trellis.runtime.harness import spawn_worker


def test_local_controller_builds_and_dispatches():
    cfg = OmegaConf.create({"backend": {"name": "example_counting"}, "seed": 0})
    group = spawn_worker(LocalController(), load_plugins().registry, cfg, "actor", "unused", None)
    backend = group.workers[0].backend
    assert backend.built and backend.spec.dist.world_size == 1
    out = group.log_prob(Batch({"responses": torch.ones(4, 3, dtype=torch.long), "unread": torch.zeros(4)}))
    assert out["log_probs"].shape == (4, 3) and backend.calls == 1
    with pytest.raises(AttributeError, match="role 'actor' has no dispatched verb 'logprob'"):
        group.logprob  # noqa: B018 - the attribute access itself must fail


def run_cli(*args: str, cwd=None):
    return run_in_process(*args, cwd=cwd or ".")


def test_plugins_command_lists_plugins():
    out = run_cli("plugins")
    assert out.returncode == 0, out.stderr
    assert "core  (trellis-core 0.1.0)" in out.stdout
    assert "example  (trellis-example-plugin 0.1.0)" in out.stdout and "recipe: example_echo" in out.stdout


def test_plugins_command_with_core_alone_says_nothing_installed(capsys, monkeypatch):
    monkeypatch.setattr(cli, "load_plugins", lambda: load_plugins(entry_points=False))
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("core  (trellis-core 0.1.0)")
    assert "no training backend is installed (backend)" in out
    assert "no rollout engine is installed (rollout)" in out


def test_train_runs_recipe_and_saves_resolved_config(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("recipe: example_echo\ndata:\n  path: d.jsonl\n")
    run_dir = tmp_path / "run"
    out = run_cli("train", str(cfg), f"trainer.run_dir={run_dir}", "trainer.total_steps=3", "advantage.scale=0.5")
    assert out.returncode == 0, out.stderr
    saved = (run_dir / "config.yaml").read_text()
    assert "total_steps: 3" in saved and "scale: 0.5" in saved
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and lines[1]["loss"] == 0.5


def test_train_config_error_exits_2_with_message(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("recipe: example_echo\ndata:\n  path: d.jsonl\n")
    out = run_cli("train", str(cfg), "trainer.totl_steps=3")
    assert out.returncode == 2
    assert "trellis: error: unknown config key 'trainer.totl_steps'" in out.stderr


def test_a_flag_among_overrides_is_named_alone_with_the_override_form(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("recipe: example_echo\ndata:\n  path: d.jsonl\n")
    out = run_cli("train", str(cfg), "trainer.total_steps=3", "--lr", "1e-4", "--dry-run")
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == (
        "trellis: error: unrecognized arguments: --lr 1e-4; config overrides are key=value, e.g. actor.optim.lr=1e-5 "
        "(trellis config show CONFIG lists the keys)"
    )


def test_train_names_an_installed_plugin_that_failed_to_load(tmp_path, broken_vllm_plugin):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("recipe: example_echo\ndata:\n  path: d.jsonl\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(broken_vllm_plugin), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "trellis.cli", "train", str(cfg), f"trainer.run_dir={tmp_path / 'run'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "failed to load" in line]
    assert len(warnings) == 1 and "WARNING trellis: plugin 'vllm' (trellis-rollout-vllm 0.1.0) failed to load" in warnings[0]
    assert "ModuleNotFoundError: No module named 'vllm_engine_that_is_not_installed'" in warnings[0]
