"""Test helper, run as a script: a recipe that kills itself with SIGKILL at a chosen point.

python killable.py update N key=value ...      # inside step N, as the actor's update starts
python killable.py checkpoint N key=value ...  # while checkpoint N is written: after the actor's
                                               # shard, before the manifest and the rename
python killable.py saved N key=value ...       # once checkpoint N is complete (for the last
                                               # step: before the final validation and export)
python killable.py prune N key=value ...       # once checkpoint N is complete, while an older one
                                               # is deleted (renamed, not yet removed)
python killable.py hf_model 0 key=value ...    # while the end's hf_model is written (weights in
                                               # its temporary folder, the tokenizer not yet)
"""

from __future__ import annotations

import os
import shutil
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
    elif point == "prune":
        rmtree = shutil.rmtree

        def rmtree_unless_pruning(path, *args, **kwargs):
            path = Path(path)
            if path.name.endswith(".deleting") and (path.parent / f"checkpoint-{step}").is_dir():
                die()
            return rmtree(path, *args, **kwargs)

        shutil.rmtree = rmtree_unless_pruning
    elif point == "hf_model":
        from transformers import PreTrainedTokenizerBase

        save_pretrained = PreTrainedTokenizerBase.save_pretrained

        def save_unless_in_hf_model(self, folder, *args, **kwargs):
            if Path(folder).name.startswith(".hf_model.tmp-"):
                die()
            return save_pretrained(self, folder, *args, **kwargs)

        PreTrainedTokenizerBase.save_pretrained = save_unless_in_hf_model
    else:
        raise SystemExit(f"unknown kill point {point!r}; valid: update, checkpoint, saved, prune, hf_model")


if __name__ == "__main__":
    kill_at(sys.argv[1], int(sys.argv[2]))
    train(None, sys.argv[3:])
    raise SystemExit("the run ended without being killed")
