"""Trackers: each one's output read back with its own library's reader (tensorboard's event files,
wandb's offline run file, MLflow's local file store), several at once, resumed runs, and a missing
library caught by the config check with the pip command."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from trellis.config import ConfigError
from trellis.plugins import load_plugins
from trellis.runtime.harness import Trackers

STEPS = {1: {"reward/mean": 0.25, "actor/pg_loss": -0.5}, 2: {"reward/mean": 0.5, "actor/pg_loss": -0.25}, 3: {"reward/mean": 0.75}}


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


def log_run(registry, names, run_dir: Path, steps=STEPS, start_step: int = 0) -> None:
    trackers = Trackers(names, registry, run_dir, 3, start_step=start_step)
    for step, metrics in steps.items():
        trackers.log(step, {**metrics, "note": "not a number"})
    trackers.close()


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


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


def test_tensorboard_scalars_read_back(registry, tmp_path):
    pytest.importorskip("tensorboard")
    log_run(registry, ["tensorboard"], tmp_path)
    assert tensorboard_scalars(tmp_path) == {"reward/mean": [(1, 0.25), (2, 0.5), (3, 0.75)], "actor/pg_loss": [(1, -0.5), (2, -0.25)]}
    log_run(registry, ["tensorboard"], tmp_path, {2: {"reward/mean": 0.125}}, start_step=1)  # resumed after step 1
    assert tensorboard_scalars(tmp_path)["reward/mean"] == [(1, 0.25), (2, 0.125)]


def wandb_records(run_file: Path) -> list:
    """The protobuf records of an offline ``.wandb`` file (a LevelDB-style log: 32 KiB blocks of
    pieces, each with a 7-byte header: checksum, length, kind)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, out = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            out.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return out


def items(entries) -> dict:
    return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}


def test_wandb_offline_run_reads_back(registry, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "config.yaml").write_text("recipe: rl\nseed: 3\n")
    log_run(registry, ["wandb"], tmp_path)
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert run_file.name == f"run-{(tmp_path / 'wandb' / 'run_id').read_text()}.wandb"
    records = wandb_records(run_file)
    history = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [{k: v for k, v in row.items() if k[0] != "_" or k == "_step"} for row in history] == [
        {"_step": 1, "reward/mean": 0.25, "actor/pg_loss": -0.5},
        {"_step": 2, "reward/mean": 0.5, "actor/pg_loss": -0.25},
        {"_step": 3, "reward/mean": 0.75},
    ]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == tmp_path.name and run.project == "trellis"
    assert {k: v for k, v in items(run.config.update).items() if k[0] != "_"} == {"recipe": "rl", "seed": 3}  # the run's config.yaml


def test_mlflow_local_file_store_reads_back(registry, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    (tmp_path / "config.yaml").write_text("recipe: rl\n")
    log_run(registry, ["mlflow"], tmp_path)
    log_run(registry, ["mlflow"], tmp_path, {4: {"reward/mean": 1.0}}, start_step=3)  # a resumed run continues the same MLflow run
    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run((tmp_path / "mlflow_run_id").read_text())
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [(1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml"]


def test_several_trackers_at_once(registry, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    log_run(registry, ["console", "jsonl", "tensorboard"], tmp_path)
    assert "step 3: note=not a number reward/mean=0.75" in capsys.readouterr().err
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert len(tensorboard_scalars(tmp_path)["reward/mean"]) == 3


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_missing_tracker_library_fails_the_config_check_with_the_pip_command(registry, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    message = rf"config key 'trainer.trackers\[1\]': tracker '{name}' needs {name} .*pip install 'trellis-core\[{name}\]'"
    with pytest.raises(ConfigError, match=message):
        Trackers.check(["jsonl", name], registry)


def test_unknown_tracker_fails_the_config_check_with_the_installed_names(registry):
    with pytest.raises(ConfigError, match=r"config key 'trainer.trackers\[0\]': tracker 'tensorbord' is not installed.*tensorboard"):
        Trackers.check(["tensorbord"], registry)


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
