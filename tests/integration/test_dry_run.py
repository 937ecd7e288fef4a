"""``trellis train --dry-run`` runs every check that needs no model and writes nothing; a real
run stopped by a check leaves no run folder behind."""

from __future__ import annotations

import pytest
from cli_runs import run_cli
from transformers import AutoTokenizer

from trellis.data import load_rows
from trellis_demo.tasks import make_arithmetic_split, write_rows


@pytest.fixture
def trellis_cli(tiny_model_path, data_files, tmp_path):
    """``trellis_cli(*args)``: ``trellis train <run.yaml> *args`` in ``tmp_path`` (the rl recipe on the tiny model)."""
    config = tmp_path / "run.yaml"
    config.write_text(
        f"recipe: rl\nmodel: {{path: {tiny_model_path}}}\n"
        f"data: {{train_path: {data_files['train']}, val_path: {data_files['test']}, train_batch_prompts: 4}}\n"
        "sampling: {n: 2, max_new_tokens: 4}\ntrainer: {total_steps: 1, trackers: [jsonl]}\n"
    )

    def run(*args: str):
        return run_cli("train", str(config), *args, cwd=tmp_path)

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
        (
            ["data.max_prompt_length=500", "sampling.max_new_tokens=64"],
            "config keys 'data.max_prompt_length' (500) + 'sampling.max_new_tokens' (64) = 564 tokens, more than the 512 positions of model.path",
        ),
        (["data.train_batch_prompts=100"], "the dataset has 64 prompts, fewer than one batch of 100; lower data.train_batch_prompts or add data"),
        (["reward.name=auto"], "config key 'reward.name' is auto, which has no reward for data_source 'arithmetic' (in data.train_path"),
        (["reward.terms=[{name: gsm8k},{name: gsm8kk}]"], "config key 'reward.terms[1].name': reward 'gsm8kk' is not installed"),
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


GSM8K = "multi_turn.interactions=[{name: gsm8k, component: gsm8k}]"


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (
            [GSM8K],  # multi_turn.enable is false
            "but multi_turn.enable is false, so it would be ignored; set multi_turn.enable to true to sample conversations, "
            "or drop multi_turn.interactions",
        ),
        (
            ["multi_turn.enable=true", GSM8K],  # the arithmetic rows carry no interaction_kwargs
            "row 0 has no extra_info.interaction_kwargs.ground_truth, which interaction 'gsm8k' needs to start (it needs ground_truth); "
            "give every row extra_info.interaction_kwargs with them, in verl's schema (e.g. {name: gsm8k, ground_truth: ...})",
        ),
        (
            [
                "multi_turn.enable=true",
                "multi_turn.tools=[{component: code_interpreter, schema: {type: function, function: {name: run, paramters: {type: object}}}}]",
            ],  # fmt: skip
            "config key 'multi_turn.tools[0].schema.function.paramters' is not a key of an OpenAI function schema (did you mean 'parameters'?)",
        ),
        (
            [
                "multi_turn.enable=true",
                "multi_turn.tools=[{component: code_interpreter, schema: {type: function, "
                "function: {name: run, parameters: {type: object, properties: {code: {type: string}}, required: [src]}}}}]",
            ],  # fmt: skip
            "config key 'multi_turn.tools[0].schema.function.parameters.required' names 'src', which parameters.properties does not define",
        ),
        (
            ["multi_turn.enable=true", "multi_turn.tools=[{component: code_interpreter}]"],  # its server's address is missing
            "config key 'multi_turn.tools[0].options': tool code_interpreter needs the server's address: set its option url=",
        ),
    ],
    ids=[
        "interactions-while-disabled",
        "rows-without-interaction-kwargs",
        "misspelled-schema-key",
        "schema-requires-undefined-argument",
        "tool-without-its-server",
    ],
)
def test_multi_turn_settings_that_would_be_ignored_or_fail_later_stop_both(trellis_cli, tmp_path, overrides, error):
    for flag in (["--dry-run"], []):
        out = trellis_cli(*flag, *overrides)
        assert out.returncode == 2, out.stderr
        last = out.stderr.splitlines()[-1]
        assert last.startswith("trellis: error: ") and error in last, out.stderr[-2000:]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


@pytest.fixture
def feedback_data(tmp_path_factory):
    """Arithmetic rows that name the gsm8k interaction and give it the ground truth."""
    return write_rows(make_arithmetic_split(8, 0, max_value=50, interaction="gsm8k"), tmp_path_factory.mktemp("feedback") / "train.jsonl")


def test_a_reward_function_multi_turn_scoring_never_calls_is_refused(trellis_cli, tmp_path, feedback_data):
    reward = tmp_path / "mine.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    base = ["multi_turn.enable=true", GSM8K, f"data.train_path={feedback_data}", "data.val_path=null", f"reward.path={reward}", "reward.name=score"]
    out = trellis_cli("--dry-run", *base)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == (
        f"trellis: error: config key 'reward.path' is {str(reward)!r}, but multi_turn.score=last takes each sample's reward from the "
        "interaction's scores and never calls it; set multi_turn.score=reward to score trajectories with your function, or drop reward.path"
    )
    out = trellis_cli("--dry-run", *base, "multi_turn.score=reward")
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_default_multi_turn_token_budget_warns_that_it_counts_the_replies(trellis_cli, feedback_data):
    base = ["multi_turn.enable=true", GSM8K, f"data.train_path={feedback_data}", "data.val_path=null"]
    out = trellis_cli("--dry-run", *base)
    assert out.returncode == 0, out.stderr[-2000:]
    # sampling.max_new_tokens=4 (the fixture's config) x the default 2 assistant turns
    assert "all turns share sampling.max_new_tokens x multi_turn.max_assistant_turns = 4 x 2 = 8 tokens" in out.stderr
    assert "set multi_turn.max_response_tokens to 8 plus the tokens of the replies you expect" in out.stderr
    out = trellis_cli("--dry-run", *base, "multi_turn.max_response_tokens=40")
    assert out.returncode == 0 and "max_response_tokens" not in out.stderr


def test_dry_run_names_what_the_config_needs_installed(tiny_model_path, data_files, tmp_path, monkeypatch):
    """math-verify for auto's MATH rows stops --dry-run, as the run itself would stop at its first
    MATH sample (here: as if not installed; trellis-ray for trainer.controller=ray: tests/core/test_config.py)."""
    import importlib.util

    from trellis.recipes.train import train

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    base = [f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}", "data.train_batch_prompts=4", "sampling.n=2"]
    rows = load_rows(data_files["train"])
    for row in rows:
        row["data_source"] = "lighteval/MATH"
    math = write_rows(rows, tmp_path / "math.parquet")
    with pytest.raises(Exception, match=r"data_source 'lighteval/MATH' \(in data.train_path\) with math-verify, not installed"):
        train(None, ["recipe=rl", *base, f"data.train_path={math}", "reward.name=auto"], dry_run=True)
