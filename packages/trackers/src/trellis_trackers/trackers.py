"""The trackers of experiment tools (kind ``tracker``): ``tensorboard``, ``wandb`` and ``mlflow``, each
needing its library (the extras ``trellis-trackers[tensorboard]``, ``[wandb]``, ``[mlflow]``)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from trellis import Tracker


class TensorBoardTracker(Tracker):
    """Scalars in ``<run_dir>/tensorboard`` (``tensorboard --logdir <run_dir>``); a resumed run hides
    the events after its checkpoint's step."""

    requires = ("tensorboard", "trellis-trackers[tensorboard]")

    def __init__(self, run_dir: Path, total_steps: int) -> None:
        self.log_dir = Path(run_dir) / "tensorboard"
        self.purge_step: int | None = None
        self.writer = None  # made at the first log, once a resume has said where to purge from

    def resume(self, step: int) -> None:
        self.purge_step = step + 1

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir), purge_step=self.purge_step)
        for key, value in numbers(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run in ``<run_dir>/wandb``, named after the run folder, with the run's
    config; project ``$WANDB_PROJECT`` (default ``trellis``); ``WANDB_MODE=offline`` works with no
    network. A resumed run continues the same wandb run (its id is kept in ``wandb/run_id``)."""

    requires = ("wandb", "trellis-trackers[wandb]")

    def __init__(self, run_dir: Path, total_steps: int) -> None:
        import wandb

        folder = Path(run_dir) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "trellis"),
            name=Path(run_dir).name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=run_config(run_dir),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(numbers(metrics), step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # waits until wandb's service has written everything to disk


class MlflowTracker(Tracker):
    """An MLflow run named after the run folder, in experiment ``$MLFLOW_EXPERIMENT_NAME`` (default
    ``trellis``), at ``$MLFLOW_TRACKING_URI`` (default: a local file store, ``<run_dir>/mlruns``).
    The config is logged as an artifact; a resumed run continues the same MLflow run."""

    requires = ("mlflow", "trellis-trackers[mlflow]")

    def __init__(self, run_dir: Path, total_steps: int) -> None:
        from mlflow.tracking import MlflowClient

        run_dir = Path(run_dir)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this opt-in for a file store
        self.client = MlflowClient(uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "trellis")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        id_file = run_dir / "mlflow_run_id"
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            run_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(self.run_id)
            if (run_dir / "config.yaml").is_file():
                self.client.log_artifact(self.run_id, str(run_dir / "config.yaml"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in numbers(metrics).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def run_config(run_dir: Path) -> dict[str, Any]:
    """The run's saved ``config.yaml`` as a plain dict (empty when there is none)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path))
