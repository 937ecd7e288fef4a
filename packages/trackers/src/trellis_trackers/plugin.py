"""trellis-trackers' entry point: the trackers ``tensorboard``, ``wandb`` and ``mlflow``."""

from trellis import hookimpl
from trellis_trackers.trackers import MlflowTracker, TensorBoardTracker, WandbTracker


@hookimpl
def trellis_register(registry):
    registry.add("tracker", "tensorboard", TensorBoardTracker)
    registry.add("tracker", "wandb", WandbTracker)
    registry.add("tracker", "mlflow", MlflowTracker)
