"""Core's trackers (console, jsonl): resumed runs, console lines and summary, an unknown tracker
caught by the config check with the installed names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tracker_runs import log_run

from trellis.config import ConfigError
from trellis.plugins import load_plugins
from trellis.runtime.harness import Trackers


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


def test_jsonl_resume_drops_the_rows_after_the_checkpoint(registry, tmp_path):
    log_run(registry, ["jsonl"], tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')  # a line cut short by a kill
    log_run(registry, ["jsonl"], tmp_path, {2: {"reward/mean": 0.9}}, start_step=1)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 0.25), (2, 0.9)]


def test_a_fresh_restart_drops_everything_an_earlier_attempt_logged(registry, tmp_path):
    """Killed after step 1 was logged but before any checkpoint: the relaunch starts at step 0."""
    log_run(registry, ["jsonl"], tmp_path, {0: {"val/reward_mean": 0.5}, 1: {"reward/mean": 0.25}})
    log_run(registry, ["jsonl"], tmp_path, {0: {"val/reward_mean": 0.5}, 1: {"reward/mean": 0.75}, 2: {"reward/mean": 1.0}})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["reward/mean"] == 0.75


def test_unknown_tracker_fails_the_config_check_with_the_installed_names(registry):
    with pytest.raises(ConfigError, match=r"config key 'trainer.trackers\[0\]': tracker 'jsonll' is not installed.*did you mean 'jsonl'"):
        Trackers.check(["jsonll"], registry)


def test_console_prints_a_bar_and_a_bounded_number_of_lines(registry, tmp_path, capsys):
    console = registry.get("tracker", "console").obj(tmp_path, 100)
    for step in range(1, 101):
        console.log(step, {"reward/mean": step / 100, **({"val/reward_mean": 0.5} if step == 50 else {})})
    console.close()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    # every 100 // 25 = 4 steps, plus step 1 (the first), step 50 (validation) and step 100 (the last)
    assert [int(x.split(":")[0].split()[1]) for x in lines] == sorted({1, 50, 100, *range(4, 101, 4)})


def test_console_without_a_terminal_prints_plain_lines_only(tmp_path):
    """stderr redirected to a file: the chosen lines and no progress-bar redraws between them."""
    code = (
        "from pathlib import Path; from trellis.runtime.trackers import ConsoleTracker\n"
        f"c = ConsoleTracker(Path({str(tmp_path)!r}), 8)\n"
        "for step in range(1, 9): c.log(step, {'reward/mean': step / 8})\n"
        "c.close()\n"
    )
    with open(tmp_path / "err.log", "w") as err:
        assert subprocess.run([sys.executable, "-c", code], stderr=err).returncode == 0
    text = (tmp_path / "err.log").read_text()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines[:8] == [f"step {s}: reward/mean={s / 8:.4g}" for s in range(1, 9)]
    # the summary: means of steps 1-4 and 5-8 (a short run's two ends do not overlap)
    assert lines[8:] == [
        "run summary, steps 1-8:",
        "  figure                                   start       end    change",
        "  reward/mean (training, 4-step means)    0.3125    0.8125   +0.5000",
    ]


def test_console_ends_with_training_figures_beside_held_out_ones(registry, tmp_path, capsys):
    """A training reward that climbs while held-out accuracy stands still shows in one table: the
    training figure's first and last 10-step means, each held-out figure's first and last value."""
    console = registry.get("tracker", "console").obj(tmp_path, 40)
    console.log(0, {"val/greedy_reward_mean": 0.573})
    for step in range(1, 41):
        console.log(step, {"reward/mean": 0.85 + 0.1 * (step > 20), "sft/note": 1.0})
    console.log(40, {"val/greedy_reward_mean": 0.584})
    console.close()
    table = capsys.readouterr().err.split("run summary, steps 0-40:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in table] == ["figure", "reward/mean", "val/greedy_reward_mean"]
    assert table[1].split()[-3:] == ["0.8500", "0.9500", "+0.1000"] and "10-step means" in table[1]
    assert table[2].split()[-3:] == ["0.5730", "0.5840", "+0.0110"] and "held-out, steps 0 and 40" in table[2]
