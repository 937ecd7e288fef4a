"""``trellis train --dry-run`` runs every check that needs no model and writes nothing; a real
run stopped by a check leaves no run folder behind."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from trellis.data import load_rows


@pytest.fixture
def trellis_cli(tiny_model_path, data_files, tmp_path):
    """``trellis_cli(*args)``: ``trellis train <run.yaml> *args`` in ``tmp_path`` (the rl recipe on the tiny model)."""
    config = tmp_path / "run.yaml"
    config.write_text(
        f"recipe: rl\nmodel: {{path: {tiny_model_path}}}\n"
        f"data: {{train_path: {data_files['train']}, val_path: {data_files['test']}, train_batch_prompts: 4}}\n"
        "sampling: {n: 2, max_new_tokens: 4}\ntrainer: {total_steps: 1, trackers: [jsonl]}\n"
    )

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trellis.cli", "train", str(config), *args], cwd=tmp_path, capture_output=True, text=True)

    return run


def test_dry_run_reports_the_data_and_writes_nothing(trellis_cli, tmp_path, tiny_model_path, data_files):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rows = load_rows(data_files["train"])
    longest = max(len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"]) for r in rows)
    out = trellis_cli("--dry-run", "trainer.run_dir=out")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "dry run of recipe rl: every check that needs no model passed",
        "  run folder: out (a fresh run; nothing written)",
        f"  data: 64 training prompts (longest {longest} tokens of data.max_prompt_length=256), 8 held-out",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


def test_data_paths_take_a_list_of_files_read_one_after_another(trellis_cli, data_files):
    out = trellis_cli("--dry-run", f"data.train_path=[{data_files['train']},{data_files['test']}]", f"data.val_path=[{data_files['test']}]")
    assert out.returncode == 0, out.stderr
    assert "data: 72 training prompts (" in out.stdout and "), 8 held-out" in out.stdout


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["data.max_prompt_length=5"], "all 64 prompts are longer than max_prompt_length=5 tokens (shortest 1"),
        (
            ["data.train_batch_prompts=3", "sampling.n=3", "trainer.controller=ray", "trainer.procs_per_node=2"],
            "9 samples, which 2 data-parallel ranks",
        ),
        (["actor.mini_batch_samples=3"], "config key 'actor.mini_batch_samples' is 3, but a step has"),
        (["trainer.trackers=[wandbb]"], "tracker 'wandbb' is not installed"),
        (["algorithm.advantage.name=grpoo"], "advantage 'grpoo' is not installed"),
        (["data.val_path=missing.jsonl"], "config key 'data.val_path': file 'missing.jsonl' does not exist"),
        (["data.val_path=[missing.jsonl]"], "config key 'data.val_path': file 'missing.jsonl' does not exist"),
        (["data.train_path=[]"], "config key 'data.train_path' is an empty list; give a parquet or jsonl file, or a list of them"),
        (["data.train_path={a: 1}"], "config key 'data.train_path' has value {'a': 1} but expects type str | list[str]"),
        (["sampling.n=0"], "config key 'sampling.n' is 0; it must be >= 1"),
        (["reward.name=auto"], "config key 'reward.name' is auto, which has no reward for data_source 'arithmetic' (in data.train_path"),
    ],
)
def test_dry_run_and_train_stop_at_the_same_check_without_a_run_folder(trellis_cli, tmp_path, overrides, error):
    for flag in (["--dry-run"], []):
        out = trellis_cli(*flag, *overrides)
        assert out.returncode == 2, out.stderr
        assert out.stderr.splitlines()[-1].startswith("trellis: error: ") and error in out.stderr, out.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # no runs/rl-<time>/config.yaml


def test_a_run_whose_rewards_fail_too_often_stops_with_the_share(trellis_cli, tmp_path):
    reward = tmp_path / "broken.py"
    reward.write_text("def half(data_source, solution_str, ground_truth, extra_info=None):\n    return 1 / (extra_info['index'] % 2)\n")
    out = trellis_cli(f"reward.path={reward}", "reward.name=half", "reward.max_error_rate=0.25", "trainer.run_dir=out")
    assert out.returncode == 2
    assert "trellis: error: reward 'half (" in out.stderr and "above reward.max_error_rate=0.25" in out.stderr, out.stderr[-2000:]
