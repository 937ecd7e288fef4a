"""The ``gsm8k`` interaction alone, and multi-turn RL with it end to end on the tiny model (the HF
engine, verl-format data with ``interaction_kwargs``)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from omegaconf import OmegaConf

from trellis.config import ConfigError, validate
from trellis.plugins import load_plugins
from trellis.recipes.train import train
from trellis_demo.tasks import make_arithmetic_split, write_rows
from trellis_interactions.answer_check import AnswerCheck, AnswerCheckOptions

MULTI_TURN = [
    "multi_turn.enable=true",
    "multi_turn.max_assistant_turns=2",
    "multi_turn.max_user_turns=1",
    "multi_turn.max_response_tokens=40",
    "multi_turn.interactions=[{name: gsm8k, component: gsm8k}]",
]


def test_right_answer_ends_wrong_answer_asks_again():
    check = AnswerCheck(AnswerCheckOptions(feedback="no", wrong_score=-0.5))

    async def episode():
        await check.start("a", ground_truth=46)
        wrong = await check.respond("a", [{"role": "assistant", "content": "#### 45"}])
        none = await check.respond("a", [{"role": "assistant", "content": "46"}])  # strict: no ####
        right = await check.respond("a", [{"role": "assistant", "content": "so #### 46"}])
        await check.finalize("a")
        return wrong, none, right

    wrong, none, right = asyncio.run(episode())
    assert (wrong.done, wrong.message, wrong.score) == (False, "no", -0.5)
    assert (none.done, none.score) == (False, -0.5)
    assert (right.done, right.score) == (True, 1.0)
    assert check.truths == {}


def test_missing_ground_truth_and_bad_method_are_named():
    key = "multi_turn.interactions[0].options.method"
    with pytest.raises(ConfigError, match=rf"'{re.escape(key)}' is 'strikt'; valid values: strict, flexible; did you mean 'strict'"):
        validate(OmegaConf.create({"method": "strikt"}), AnswerCheckOptions, load_plugins().registry, key.removesuffix("method"))
    with pytest.raises(ValueError, match="interaction_kwargs.ground_truth"):
        asyncio.run(AnswerCheck().start("a", ground_truth=None))  # a null in the data; a missing key is found by the recipe's check


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    return {
        "train": str(write_rows(make_arithmetic_split(32, 0, max_value=30, interaction="gsm8k"), folder / "train.parquet")),
        "test": str(write_rows(make_arithmetic_split(8, 0, split="test", max_value=30, interaction="gsm8k"), folder / "test.jsonl")),
        "unknown": str(write_rows(make_arithmetic_split(4, 0, max_value=30, interaction="nope"), folder / "unknown.jsonl")),
    }


def base(model, files, run_dir):
    return [
        "recipe=rl",
        f"model.path={model}",
        f"data.train_path={files['train']}",
        f"data.val_path={files['test']}",
        "data.train_batch_prompts=4",
        "sampling.n=4",
        "sampling.max_new_tokens=6",
        "trainer.total_steps=2",
        "trainer.trackers=[jsonl]",
        f"trainer.run_dir={run_dir}",
    ]


def test_multiturn_rl_runs_on_verl_format_data(tiny_model_path, files, tmp_path):
    summary = train(None, [*base(tiny_model_path, files, tmp_path / "run"), *MULTI_TURN])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "multiturn/num_turns_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert 1.0 <= r["multiturn/num_turns_mean"] <= 2.0 and r["multiturn/env_errors"] == 0
        # a sample ends right after a right answer, or after its second answer
        assert r.get("multiturn/finish_done", 0) + r.get("multiturn/finish_max_assistant_turns", 0) + r.get("multiturn/finish_max_user_turns", 0) == 1
        assert 0.0 <= r["reward/first_turn_mean"] <= r["reward/mean"] + 1e-9  # a second try can only add
        assert "actor/pg_loss" in r
    for key in ("val_before", "val_after"):
        val = summary[key]
        assert val["greedy_first_turn_reward_mean"] <= val["greedy_reward_mean"] + 1e-9


def test_unknown_interaction_in_data_is_found_before_any_model_is_built(tiny_model_path, files, tmp_path):
    overrides = [*base(tiny_model_path, files, tmp_path / "bad"), f"data.train_path={files['unknown']}", *MULTI_TURN]
    with pytest.raises(ConfigError, match=r"row 0 names interaction 'nope'.*configured: gsm8k"):
        train(None, overrides)
    assert not (tmp_path / "bad").exists()
