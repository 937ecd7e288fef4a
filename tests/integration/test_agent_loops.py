"""Agent loops through the rl recipe: rows pick a test-only loop where the environment speaks
first (registered by an in-process plugin, ``tests/agent_loops.py``) by their ``agent_name``
column, and a loop the data names that is not installed is found before any model is built."""

from __future__ import annotations

import json

import agent_loops
import pytest
from multiturn_runs import multi_turn_run

from trellis.config import ConfigError
from trellis.plugins import load_plugins
from trellis.recipes.train import train
from trellis_demo.tasks import make_arithmetic_split, write_rows
from trellis_multiturn.sampled import NotSampled

OBSERVATION = {"role": "user", "content": agent_loops.OBSERVATION}


def rows(n: int, split: str, agent_names: list[str | None]) -> list[dict]:
    """Arithmetic rows whose ``agent_name`` cycles through ``agent_names`` (None: no column value)."""
    out = make_arithmetic_split(n, 0, split=split, max_value=30, interaction="answer")
    for i, row in enumerate(out):
        row["agent_name"] = agent_names[i % len(agent_names)]
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    return {
        "train": str(write_rows(rows(16, "train", ["observation_first"]), folder / "train.parquet")),
        "test": str(write_rows(rows(8, "test", ["observation_first", None]), folder / "test.jsonl")),  # both loops in one batch
        "unknown": str(write_rows(rows(4, "train", [None, "react"]), folder / "unknown.jsonl")),
        "retokenized": str(write_rows(rows(8, "train", ["retokenized"]), folder / "retokenized.parquet")),
    }


def overrides(model, files, run_dir):
    interaction = "multi_turn.interactions=[{name: answer, component: contains_answer}]"
    return multi_turn_run(model, files["train"], run_dir, "multi_turn.max_response_tokens=64", interaction, val_path=files["test"])


def test_rl_trains_on_a_loop_where_the_environment_speaks_first(tiny_model_path, files, tmp_path):
    """Every training row names ``observation_first`` (the default stays ``tool_agent``): each
    sample is one observation then one model turn; validation mixes both loops."""
    agent_loops.SEEN.clear()
    plugins = load_plugins(extra=[("agent_loops", agent_loops)])
    summary = train(None, overrides(tiny_model_path, files, tmp_path / "run"), plugins=plugins)
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "multiturn/num_turns_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["multiturn/finish_answered"] == 1.0 and r["multiturn/num_turns_mean"] == 1.0 and r["multiturn/user_turns_mean"] == 1.0
        assert "actor/pg_loss" in r and r["multiturn/env_errors"] == 0
    # conversations the interaction scored after the observation: 2 steps x 4 prompts x 2 samples in
    # training, and the 4 observation-first held-out rows x (greedy + sampled) x (before + after)
    observed = [c for c in agent_loops.SEEN if c[1:2] == [OBSERVATION]]
    assert len(observed) == 2 * 4 * 2 + 4 * 2 * 2
    assert all(len(c) == 3 and c[2]["role"] == "assistant" for c in observed)
    assert len(agent_loops.SEEN) > len(observed)  # the held-out rows without agent_name ran tool_agent
    assert set(summary) == {"val_before", "val_after"}


def test_conversations_of_other_prompt_widths_train_on_their_sampled_tokens(tiny_model_path, tmp_path):
    """Multi-turn samples whose prompts differ in width (the question asked 1 to 3 times), built by
    core's tool_agent loop with an interaction: every batch passes the alignment check, and the
    trainer's log-probs of the model's turns equal the engine's (one module) to float noise."""
    out = rows(8, "train", [None])
    for i, row in enumerate(out):
        row["prompt"][0]["content"] *= 1 + i % 3
    train_file = write_rows(out, tmp_path / "widths.parquet")
    interaction = "multi_turn.interactions=[{name: answer, component: contains_answer}]"
    run_dir = tmp_path / "run"
    plugins = load_plugins(extra=[("agent_loops", agent_loops)])
    train(None, multi_turn_run(tiny_model_path, train_file, run_dir, "multi_turn.max_response_tokens=32", interaction), plugins=plugins)
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in r]
    assert len(steps) == 2 and all(r["multiturn/num_turns_mean"] >= 1 for r in steps)
    assert all(r["sync/batch_gap"] < 1e-5 for r in steps), [r["sync/batch_gap"] for r in steps]


def test_unknown_agent_loop_in_the_data_is_found_before_any_model_is_built(tiny_model_path, files, tmp_path):
    plugins = load_plugins(extra=[("agent_loops", agent_loops)])
    args = [*overrides(tiny_model_path, files, tmp_path / "bad"), f"data.train_path={files['unknown']}"]
    installed = "example_one_turn, observation_first, openai_agent, outside_retell, retokenized, tool_agent"  # every installed plugin's
    unknown = rf"data.train_path '.*unknown.jsonl': row 1 has agent_name='react', which is not an installed agent loop \(installed: {installed}\)"
    with pytest.raises(ConfigError, match=unknown):
        train(None, args, plugins=plugins, dry_run=True)
    misspelt = (
        r"config key 'multi_turn.agent_loop' is 'observation_frist': agent_loop 'observation_frist' is not installed"
        r".*did you mean 'observation_first'"
    )
    with pytest.raises(ConfigError, match=misspelt):
        train(None, [*overrides(tiny_model_path, files, tmp_path / "bad"), "multi_turn.agent_loop=observation_frist"], plugins=plugins, dry_run=True)
    assert not (tmp_path / "bad").exists()


def test_a_loop_that_re_encodes_the_models_turn_stops_the_run_before_training_on_it(tiny_model_path, files, tmp_path):
    """Trained ids must be sampled ids: the first step's rollout stops, naming the loop."""
    plugins = load_plugins(extra=[("agent_loops", agent_loops)])
    args = [*overrides(tiny_model_path, files, tmp_path / "retok"), f"data.train_path={files['retokenized']}", "data.val_path=null"]
    with pytest.raises(NotSampled, match=r"agent loop 'retokenized' trains on token \d+ .* at response position \d+, which"):
        train(None, args, plugins=plugins)
    assert not (tmp_path / "retok" / "metrics.jsonl").exists() or "actor/pg_loss" not in (tmp_path / "retok" / "metrics.jsonl").read_text()
