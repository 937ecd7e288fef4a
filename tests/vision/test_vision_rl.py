"""The rl recipe on image prompts (verl's multimodal parquet) with the tiny Qwen2-VL: it trains,
the engine's weights are synced and checked with an image prompt, and a sync that leaves the vision
tower behind stops the run."""

from __future__ import annotations

import json

import pytest
from images import image_row, squares

from trellis.examples.tasks import write_rows
from trellis.recipes.train import train
from trellis.runtime.sync_probe import SyncCheckFailed
from trellis_fsdp.backend import FSDPBackend

REWARD = "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return len(solution_str) / 20\n"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-data")
    rows = [
        image_row("<image>how many squares?", [squares(color, count, (56 + 28 * (i % 3), 56))], str(count), i)
        for i, (color, count) in enumerate([(c, k) for c in ("red", "green", "blue") for k in (1, 2, 3)] * 2)
    ]
    rows[0] = {**image_row("how many squares?", [], "1"), "images": None}  # a text row among them
    (folder / "reward.py").write_text(REWARD)
    return {"train": write_rows(rows, folder / "train.parquet"), "val": write_rows(rows[:4], folder / "val.parquet"), "reward": folder / "reward.py"}


def run(path, data, run_dir, *overrides):
    train(
        None,
        [
            "recipe=rl",
            f"model.path={path}",
            f"data.train_path={data['train']}",
            f"data.val_path={data['val']}",
            "data.train_batch_prompts=4",
            "sampling.n=4",
            "sampling.max_new_tokens=6",
            "actor.micro_batch_samples=8",
            "actor.optim.lr=1e-2",
            f"reward.path={data['reward']}",
            "reward.name=score",
            "rollout.share_actor_weights=false",  # the engine keeps its own copy: every step syncs it
            "trainer.total_steps=2",
            "trainer.trackers=[jsonl]",
            f"trainer.run_dir={run_dir}",
            *overrides,
        ],
    )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rl_trains_on_image_prompts_with_every_sync_checked_on_an_image(tiny_vision_model_path, data, tmp_path):
    rows = [r for r in run(tiny_vision_model_path, data, tmp_path / "run") if "actor/grad_norm" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["actor/grad_norm"] > 0
        assert row["sync/batch_gap"] < 1e-4  # the trainer's log-probs of the samples, images included, equal the engine's
        assert row["sync/probe_gap"] < 1e-4


def test_a_sync_that_leaves_the_vision_tower_behind_stops_the_run(tiny_vision_model_path, data, tmp_path, monkeypatch):
    """A backend whose export (its tensors and their manifest alike) has no vision tower: every
    tensor it sends loads, and only the probe, an image prompt, sees the engine's stale tower."""
    export, shapes = FSDPBackend.export_weights, FSDPBackend.weight_shapes

    def without_vision(self, *args, **kwargs):
        for bucket in export(self, *args, **kwargs):
            yield [(name, tensor) for name, tensor in bucket if ".visual." not in name]

    monkeypatch.setattr(FSDPBackend, "export_weights", without_vision)
    monkeypatch.setattr(FSDPBackend, "weight_shapes", lambda self: {k: v for k, v in shapes(self).items() if ".visual." not in k})
    with pytest.raises(SyncCheckFailed, match="rollout engine 0 of 1 \\(HFRollout\\) gives the probe's tokens log-probs"):
        run(tiny_vision_model_path, data, tmp_path / "run")
