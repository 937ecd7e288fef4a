"""``trainer.log_samples: N``: N decoded prompt/response/reward rows per step in ``samples.jsonl``,
rewound with the metrics when a run resumes from an earlier checkpoint."""

from __future__ import annotations

import json
import shutil


def samples(run_dir):
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_two_steps_write_n_rows_each_and_resume_does_not_duplicate(run_rl, tmp_path):
    run_dir = tmp_path / "run"
    run_rl("trainer.log_samples=3", "trainer.save_every_steps=1", "data.val_max_prompts=2", run_dir=run_dir)
    rows = samples(run_dir)
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    for row in rows:
        assert set(row) == {"step", "prompt", "response", "reward", "data_source", "ground_truth"}
        assert "+" in row["prompt"] and isinstance(row["reward"], float) and row["reward"] in (0.0, 1.0)
    assert rows[0]["prompt"] == rows[1]["prompt"]  # sampling.n=4: the first rows are one prompt's samples

    # killed after step 2 logged but before its checkpoint: the relaunch resumes from step 1
    shutil.rmtree(run_dir / "checkpoint-2")
    (run_dir / "finished.json").unlink(missing_ok=True)
    run_rl("trainer.log_samples=3", "trainer.save_every_steps=1", "data.val_max_prompts=2", run_dir=run_dir)
    again = samples(run_dir)
    assert [r["step"] for r in again] == [1, 1, 1, 2, 2, 2]
    assert again[:3] == rows[:3]


def test_off_by_default(run_rl, tmp_path):
    run_rl("trainer.total_steps=1", run_dir=tmp_path / "run")
    assert not (tmp_path / "run" / "samples.jsonl").exists()
