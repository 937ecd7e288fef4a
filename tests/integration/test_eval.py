"""``trellis eval`` validates model.path once and writes nothing; a 0-step training run validates
once too (before training and after it would be the same figures)."""

from __future__ import annotations

import json

import pytest

from trellis.cli import main as cli_main
from trellis_algos.rl import RLRecipe


@pytest.fixture
def validations(monkeypatch):
    """The figures of every ``RLRecipe.validate`` call, in order."""
    calls: list[dict] = []
    validate = RLRecipe.validate

    def counting(*args, **kwargs):
        calls.append(validate(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(RLRecipe, "validate", staticmethod(counting))
    return calls


def test_eval_validates_once_prints_the_figures_and_writes_nothing(tiny_model_path, data_files, tmp_path, monkeypatch, capsys, validations):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.yaml"
    data = f"{{train_path: {data_files['train']}, val_path: {data_files['test']}}}"
    config.write_text(f"recipe: rl\nmodel: {{path: {tiny_model_path}}}\ndata: {data}\n")
    assert cli_main(["eval", str(config), "sampling.max_new_tokens=6", "validation.n=2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(validations) == 1 and printed == validations[0]
    assert set(printed) == {"greedy_reward_mean", "reward_mean"} and all(0.0 <= v <= 1.0 for v in printed.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # no run folder

    assert cli_main(["eval", str(config), "data.val_path=null"]) == 2
    assert "config key 'data.val_path' is not set; trellis eval scores the held-out prompts" in capsys.readouterr().err
    assert cli_main(["eval", str(config), "recipe=sft"]) == 2
    assert "config key 'recipe': recipe 'sft' has no validation to run" in capsys.readouterr().err


def test_a_run_of_zero_steps_validates_once(run_rl, validations):
    summary, rows = run_rl("trainer.total_steps=0")
    assert len(validations) == 1 and summary == {"val_after": validations[0]}
    assert [r["step"] for r in rows] == [0]
