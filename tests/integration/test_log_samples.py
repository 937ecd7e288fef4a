"""``trainer.log_samples: N``: N decoded prompt/response/reward rows per step in ``samples.jsonl``,
spread over the step's prompts, plus the greedy held-out generations of each validation (``split``
``val``), rewound with the metrics when a run resumes from an earlier checkpoint."""

from __future__ import annotations

import json
import shutil


def samples(run_dir):
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_two_steps_write_n_rows_each_and_resume_does_not_duplicate(run_rl, tmp_path):
    run_dir = tmp_path / "run"
    run_rl("trainer.log_samples=3", "trainer.save_every_steps=1", "data.val_max_prompts=2", run_dir=run_dir)
    rows = samples(run_dir)
    # validation before training (2 held-out prompts), steps 1 and 2, the validation after step 2
    assert [(r["step"], r["split"]) for r in rows] == [(0, "val")] * 2 + [(1, "train")] * 3 + [(2, "train")] * 3 + [(2, "val")] * 2
    for row in rows:
        assert set(row) == {"step", "split", "prompt", "response", "reward", "data_source", "ground_truth"}
        assert "+" in row["prompt"] and isinstance(row["reward"], float) and row["reward"] in (0.0, 1.0)
    train = [r for r in rows if r["split"] == "train"]
    assert len({r["prompt"] for r in train[:3]}) == 3  # sampling.n=4: one sample of each of 3 prompts, not one prompt's group
    assert [r["prompt"] for r in rows[:2]] == [r["prompt"] for r in rows[-2:]]  # the same held-out prompts each time

    # killed after step 2 logged but before its checkpoint: the relaunch resumes from step 1
    shutil.rmtree(run_dir / "checkpoint-2")
    (run_dir / "finished.json").unlink(missing_ok=True)
    run_rl("trainer.log_samples=3", "trainer.save_every_steps=1", "data.val_max_prompts=2", run_dir=run_dir)
    again = samples(run_dir)
    assert [(r["step"], r["split"]) for r in again] == [(r["step"], r["split"]) for r in rows]
    assert again[:5] == rows[:5]


def test_off_by_default(run_rl, tmp_path):
    run_rl("trainer.total_steps=1", run_dir=tmp_path / "run")
    assert not (tmp_path / "run" / "samples.jsonl").exists()
