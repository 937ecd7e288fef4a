"""The README's "Train your own", run as written in a scratch folder: each command of its block but
``pip install`` as a subprocess, the keys its text says to set set in the starter, data rows shaped
like its example row and its example reward file written verbatim."""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

from omegaconf import OmegaConf

README = Path(__file__).resolve().parents[2] / "README.md"
# what the text below the commands says to set in my_run.yaml, for files made in the scratch folder
KEYS = {
    "model.path": "tiny",
    "data.train_path": "train.jsonl",
    "data.val_path": "val.jsonl",
    "reward.path": "my_reward.py",
    "reward.name": "compute_score",
}


def section() -> tuple[str, list[str]]:
    """The section's text and its indented code blocks (dedented)."""
    text = README.read_text(encoding="utf-8").split("## Train your own\n", 1)[1].split("\n## ", 1)[0]
    blocks = [textwrap.dedent(b) for b in re.findall(r"((?:^    .*\n|^\n)+)", text, re.M) if b.strip()]
    return text, [b.strip("\n") for b in blocks]


def rows(example: dict, n: int, seed: int) -> list[dict]:
    """``n`` rows like ``example`` ("What is 7+5?" -> "12") with other sums."""
    out = []
    for i in range(n):
        a, b = (seed + 3 * i) % 10, (seed + 7 * i) % 10
        row = copy.deepcopy(example)
        row["prompt"][0]["content"] = example["prompt"][0]["content"].replace("7+5", f"{a}+{b}")
        row["reward_model"]["ground_truth"] = str(a + b)
        out.append(row)
    return out


def test_the_steps_run_as_written(tmp_path):
    text, blocks = section()
    commands, example, reward = blocks[0], blocks[1], blocks[2]
    for key in KEYS:
        assert f"`{key}" in text, f"the README no longer says to set {key}"
    example = json.loads(example)
    assert example["prompt"][0]["content"] == "What is 7+5?" and example["reward_model"]["ground_truth"] == "12"
    for name, n, seed in (("train.jsonl", 32, 0), ("val.jsonl", 8, 1)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows(example, n, seed)))
    assert reward.startswith("# my_reward.py")
    (tmp_path / "my_reward.py").write_text(reward + "\n")

    lines = [line.split("  #", 1)[0].strip() for line in commands.splitlines()]
    assert lines[0].startswith("pip install") and all(line.startswith("trellis ") for line in lines[1:])
    outputs = {}
    for line in lines[1:]:
        command, _, target = line.partition(" > ")
        args = shlex.split(command)[1:]
        done = subprocess.run([sys.executable, "-m", "trellis.cli", *args], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{line}\n{done.stderr[-3000:]}"
        outputs[args[0] + (" --dry-run" if "--dry-run" in args else "")] = done.stdout
        if target:
            (tmp_path / target).write_text(done.stdout)
        if args[:2] == ["config", "init"]:  # the text: "set the keys below in it"
            starter = OmegaConf.load(tmp_path / target)
            for key, value in KEYS.items():
                OmegaConf.update(starter, key, value)
            OmegaConf.save(starter, tmp_path / target)

    assert "every check that needs no model passed" in outputs["train --dry-run"] and "8 held-out" in outputs["train --dry-run"]
    figures = json.loads(outputs["eval"].strip().splitlines()[-1])
    assert set(figures) == {"reward_mean", "greedy_reward_mean"} and all(0.0 <= v <= 1.0 for v in figures.values())
    (run,) = (tmp_path / "runs").iterdir()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "reward/mean" in r] == list(range(1, 11))  # the starter's 10 steps
    assert any("val/reward_mean" in r for r in metrics) and (run / "finished.json").is_file() and (run / "checkpoint-10").is_dir()
    config = OmegaConf.load(run / "config.yaml")
    assert (config.algorithm.advantage.name, config.actor.policy_loss.name, config.reward.path) == ("rloo", "clip_cov", "my_reward.py")
