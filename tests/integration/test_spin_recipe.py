"""The ``spin`` recipe (trellis-algos) end to end on the tiny model: pairs from reference answers
and from ranked samples, the margin DPO widens, the reference refreshed in memory, exact resume."""

from __future__ import annotations

import pytest

from trellis.config import ConfigError

LENGTH_REWARD = '''
def longer_is_better(data_source, solution_str, ground_truth, extra_info=None):
    """A stand-in preference with no ties between most samples: the response's length."""
    return float(len(solution_str))
'''


@pytest.fixture
def run_spin(tiny_model_path, data_files, tmp_path, run_recipe):
    """``run_spin(*overrides, run_dir=...)``: 4 spin steps on the tiny model; returns (summary, step rows)."""

    def run(*overrides: str, run_dir=None):
        base = [
            "recipe=spin",
            f"model.path={tiny_model_path}",
            f"data.train_path={data_files['train']}",
            f"data.val_path={data_files['test']}",
            "data.train_batch_prompts=4",
            "sampling.n=2",
            "sampling.max_new_tokens=6",
            "train.optim.lr=1e-3",
            "train.micro_batch_samples=4",
            "trainer.total_steps=4",
            "trainer.trackers=[jsonl]",
        ]
        summary, rows = run_recipe(run_dir or tmp_path / "spin", base, overrides)
        return summary, [r for r in rows if "spin/pairs" in r]

    return run


def test_reference_pairs_widen_the_margin_against_a_fixed_reference(run_spin):
    """Chosen = the dataset's answer, rejected = the model's sample: with the reference never
    refreshed, each DPO step makes the answers likelier relative to the samples."""
    summary, steps = run_spin("ref_update_every=0")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["spin/pairs"] == 8 for r in steps)
    margins = [r["actor/reward_margin"] for r in steps]
    assert margins[0] == pytest.approx(0.0, abs=1e-5)  # the first step: policy == reference
    assert margins[-1] > margins[1] > 0, margins
    assert steps[-1]["actor/reward_accuracy"] == 1.0
    assert "greedy_reward_mean" in summary["val_before"] and "greedy_reward_mean" in summary["val_after"]


def test_a_refreshed_reference_restarts_the_margin(run_spin):
    """ref <- actor after every step: each step starts from policy == reference, margin 0."""
    _, steps = run_spin("ref_update_every=1")
    assert all(r["actor/reward_margin"] == pytest.approx(0.0, abs=1e-5) for r in steps)
    assert all("timing/ref_update_s" in r for r in steps)


def test_ranked_pairs_from_the_models_own_samples(run_spin, tmp_path):
    reward = tmp_path / "length.py"
    reward.write_text(LENGTH_REWARD)
    _, steps = run_spin("pairs=ranked", "sampling.n=4", f"reward.path={reward}", "reward.name=longer_is_better", "ref_update_every=0")
    assert all(0 < r["spin/pairs"] <= 4 and r["spin/pairs"] + r["spin/tied_prompts"] == 4 for r in steps)
    assert steps[-1]["actor/reward_margin"] > 0


def test_the_policy_is_written_as_a_hugging_face_folder_and_samples_are_logged(run_spin, tmp_path):
    """``trellis config init spin`` lists ``trainer.save_hf_model`` and ``trainer.log_samples``: the
    run writes the actor's final weights as ``hf_model`` (the same logits as the checkpoint's actor
    export) and its first samples of each step, with their reward, to ``samples.jsonl``."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from trellis.export import export_checkpoint

    run_dir = tmp_path / "written"
    run_spin("trainer.total_steps=2", "trainer.save_hf_model=true", "trainer.log_samples=3", "trainer.save_every_steps=2", run_dir=run_dir)
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    assert all(isinstance(r["response"], str) and isinstance(r["reward"], float) and r["prompt"] for r in rows)
    exported = export_checkpoint(run_dir, tmp_path / "exported")
    ids = torch.tensor([[5, 9, 12, 7]])
    with torch.no_grad():
        written = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model")(ids).logits
        from_checkpoint = AutoModelForCausalLM.from_pretrained(exported)(ids).logits
    torch.testing.assert_close(written, from_checkpoint)


def test_resume_restores_the_refreshed_reference(run_spin, tmp_path):
    """The reference is part of the checkpoint: two steps, stop, two more equal four in a row."""
    _, straight = run_spin("ref_update_every=2", run_dir=tmp_path / "straight")
    run_spin("ref_update_every=2", "trainer.total_steps=2", run_dir=tmp_path / "stopped")
    _, resumed = run_spin("ref_update_every=2", run_dir=tmp_path / "stopped")
    for got, expected in zip(resumed[2:], straight[2:]):
        for key in ("actor/loss", "actor/reward_margin", "actor/grad_norm", "spin/sample_reward"):
            assert got[key] == expected[key], key


def test_bad_spin_config_fails_before_any_model_is_built(run_spin):
    with pytest.raises(ConfigError, match="config key 'pairs' is 'best'; valid values: reference, ranked; did you mean"):
        run_spin("pairs=best")
    with pytest.raises(ConfigError, match="pairs: ranked compares samples of a prompt, so it needs at least 2"):
        run_spin("pairs=ranked", "sampling.n=1")


def test_reference_pairs_without_answers_fail_before_any_model_is_built(run_spin, tmp_path, monkeypatch):
    from trellis_demo.tasks import make_arithmetic_split, write_rows

    rows = make_arithmetic_split(8, 0, max_value=50)
    for row in rows:
        row["extra_info"].pop("answer")
    data = write_rows(rows, tmp_path / "no_answers.parquet")

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the data error was found")

    monkeypatch.setattr("trellis.runtime.harness.spawn_worker", refuse)
    with pytest.raises(ConfigError, match=r"8 rows of data.train_path have none \(first: row 0\); add it, or use pairs: ranked"):
        run_spin(f"data.train_path={data}")


def test_an_adapter_policy_refreshes_its_reference_with_the_merged_weights(run_spin):
    """``train.adapter``: the reference (no adapter of its own) takes the actor's merged weights,
    so each step again starts from policy == reference (margin 0 to float rounding)."""
    _, steps = run_spin("train.adapter.rank=4", "train.optim.lr=1e-2", "ref_update_every=1")
    assert len(steps) == 4
    assert all(r["actor/reward_margin"] == pytest.approx(0.0, abs=1e-5) for r in steps)
    assert all(r["actor/grad_norm"] > 0 for r in steps)  # the adapter trains
