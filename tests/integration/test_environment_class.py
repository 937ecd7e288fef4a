"""An environment class through the rl recipe: ``multi_turn.environment`` names a class in a file,
its methods are the tools of core's ``tool_agent`` loop, and its ``reward()`` is the samples'
reward. The random tiny model cannot write a tool call, so the test plugin's parser
``always_guess`` reads every model turn as one (the trained ids are still the sampled ones)."""

from __future__ import annotations

import json
from pathlib import Path

import environments
import pytest
from multiturn_runs import multi_turn_run

from trellis.config import ConfigError
from trellis.plugins import load_plugins
from trellis.recipes.train import train
from trellis_demo.tasks import make_arithmetic_split, write_rows

GUESS_SUM = f"{Path(environments.__file__)}:GuessSum"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    no_question = make_arithmetic_split(4, 0, max_value=30)
    del no_question[2]["extra_info"]["question"]
    return {
        "train": str(write_rows(make_arithmetic_split(16, 0, max_value=30), folder / "train.parquet")),
        "no_question": str(write_rows(no_question, folder / "no_question.jsonl")),
    }


def overrides(model, train_path, run_dir, *more):
    environment = (f"multi_turn.environment={GUESS_SUM}", "multi_turn.tool_parser=always_guess", "multi_turn.max_assistant_turns=2")
    return multi_turn_run(model, train_path, run_dir, *environment, "multi_turn.max_response_tokens=200", *more)


def test_rl_trains_with_an_environment_class_and_its_reward(tiny_tools_model_path, data, tmp_path):
    """Each sample: two model turns, each read as a guess; reward() is 0.25 per guess (0.5), plus
    1 if a guess (the turn's length in characters) was the sum."""
    plugins = load_plugins(extra=[("environments", environments)])
    # the prompts carry the tools' schemas: room for them
    args = overrides(tiny_tools_model_path, data["train"], tmp_path / "run", "trainer.log_samples=8", "data.max_prompt_length=1536")
    train(None, args, plugins=plugins)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "multiturn/tool_calls" in r]
    assert len(steps) == 2
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16 and all(s["reward"] in (0.5, 1.5) for s in samples)
    for s in samples:  # multi-turn rows: the whole conversation, the guesses' replies included
        assert s["num_turns"] == 2 and s["turn_scores"] == [] and s["finish_reason"] == "max_assistant_turns"
        assert s["conversation"].count("<|im_start|>tool\n") == 1
        assert any(f"<|im_start|>tool\n{word}<|im_end|>" in s["conversation"] for word in ("right", "higher", "lower"))
    for r, step in zip(steps, (1, 2)):
        assert r["multiturn/tool_calls"] == 4 * 2 * 2 and r["multiturn/tool_errors"] == 0 and r["multiturn/env_errors"] == 0
        assert r["multiturn/finish_max_assistant_turns"] == 1.0 and "actor/pg_loss" in r
        mine = [s["reward"] for s in samples if s["step"] == step]
        assert r["reward/mean"] == pytest.approx(sum(mine) / len(mine)) and r["reward/min"] >= 0.5


def test_rows_without_what_reset_needs_and_a_misspelt_class_stop_the_run_before_any_model(tiny_model_path, data, tmp_path):
    plugins = load_plugins(extra=[("environments", environments)])
    args = overrides(tiny_model_path, data["no_question"], tmp_path / "bad")
    with pytest.raises(ConfigError, match=r"data.train_path '.*no_question.jsonl': row 2 has no extra_info.question, which multi_turn.environment"):
        train(None, args, plugins=plugins, dry_run=True)
    args = overrides(tiny_model_path, data["train"], tmp_path / "bad", f"multi_turn.environment={GUESS_SUM[:-1]}")
    misspelt = r"multi_turn.environment 'GuessSu' is not defined there in '.*environments.py'; functions found: AlwaysGuess, GuessSum"
    with pytest.raises(ConfigError, match=misspelt):
        train(None, args, plugins=plugins, dry_run=True)
    with pytest.raises(ConfigError, match=r"multi_turn.score' is reward with multi_turn.environment .* whose reward\(\) would be ignored"):
        train(None, [*overrides(tiny_model_path, data["train"], tmp_path / "bad"), "multi_turn.score=reward"], plugins=plugins, dry_run=True)
    assert not (tmp_path / "bad").exists()


def test_a_chat_template_that_ignores_tools_is_refused_before_any_model(tiny_model_path, data, tmp_path):
    """The tiny model's plain template drops ``tools``: the prompts would carry no tool schema and
    nothing would say so (the endpoint refused such a template; the in-process loop did not)."""
    plugins = load_plugins(extra=[("environments", environments)])
    refused = r"config key 'multi_turn.environment' gives the model 2 tools, but the chat template of .* does not render tools"
    with pytest.raises(ConfigError, match=refused):
        train(None, overrides(tiny_model_path, data["train"], tmp_path / "plain"), plugins=plugins, dry_run=True)
