"""trellis-trackers: each tracker's output read back with its own library's reader (tensorboard's
event files, wandb's offline run file, MLflow's local file store), several at once, resumed runs,
and a missing library caught by the config check with the pip command."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from tracker_runs import log_run

from trellis.config import ConfigError
from trellis.plugins import load_plugins
from trellis.runtime.harness import Trackers


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


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
    message = rf"config key 'trainer.trackers\[1\]': tracker '{name}' needs {name} .*pip install 'trellis-trackers\[{name}\]'"
    with pytest.raises(ConfigError, match=message):
        Trackers.check(["jsonl", name], registry)


def test_without_this_package_a_tracker_names_it(monkeypatch):
    """Core alone: a config naming one of these trackers is told which package brings it."""
    monkeypatch.setattr("trellis.registry._distribution_installed", lambda name: False)
    core = load_plugins(entry_points=False).registry
    message = r"tracker 'wandb' is not installed: pip install trellis-trackers \(installed tracker names: console, jsonl\)"
    with pytest.raises(ConfigError, match=message):
        Trackers.check(["console", "wandb"], core)
