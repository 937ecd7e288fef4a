"""Test helper, run as a script: a recipe that kills itself with SIGKILL at a chosen point.

    python killable.py update N key=value ...      # inside step N, as the actor's update starts
    python killable.py checkpoint N key=value ...  # while checkpoint N is written: after the actor's
                                                   # shard, before the manifest and the rename
    python killable.py saved N key=value ...       # once checkpoint N is complete (for the last
                                                   # step: before the final validation and export)
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from trellis.recipes.train import train
from trellis.runtime.checkpoint import Checkpointer
from trellis.runtime.worker import RoleWorker


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at(point: str, step: int) -> None:
    if point == "update":
        train, calls = RoleWorker.train, []

        def counting_update(self, verb, batch):
            if verb == "update":
                calls.append(self.spec.role)
                if calls.count("actor") == step and self.spec.role == "actor":
                    die()
            return train(self, verb, batch)

        RoleWorker.train = counting_update
    elif point == "checkpoint":
        save = RoleWorker.save

        def save_then_die(self, path):
            save(self, path)
            if self.spec.role == "actor" and Path(path).parent.name == f".checkpoint-{step}.tmp":
                die()

        RoleWorker.save = save_then_die
    elif point == "saved":
        after_step = Checkpointer.after_step

        def after_step_then_die(self, done):
            path = after_step(self, done)
            if done == step:
                die()
            return path

        Checkpointer.after_step = after_step_then_die
    else:
        raise SystemExit(f"unknown kill point {point!r}; valid: update, checkpoint, saved")


if __name__ == "__main__":
    kill_at(sys.argv[1], int(sys.argv[2]))
    train(None, sys.argv[3:])
    raise SystemExit("the run ended without being killed")
