"""Scoring while generating (``reward.stream_prompts``): the parts of a batch scored one by one give
the reward of the whole batch, and in a run the scoring of a slow reward hides behind generation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from trellis.batch import Batch
from trellis.config import ConfigError
from trellis.plugins import load_plugins
from trellis_algos.rewards import RewardConfig, RewardManager

TERMS = """
def exact(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.startswith("x"):
        raise ValueError("cannot grade")  # a failed sample: counted, scored 0
    return {"score": float(solution_str.strip() == ground_truth), "chars": float(len(solution_str))}


def short(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if len(solution_str) < 3 else 0.0
"""

SLOW = """
import time


def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.02)
    return len(solution_str) / 10
"""


def test_parts_scored_one_by_one_give_the_whole_batchs_reward(tiny_model_path, tmp_path):
    (tmp_path / "terms.py").write_text(TERMS)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    texts = ["7", "12", "x1", "7 ", "abc", "x", "12", "9"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] or [0] for t in texts]
    width = max(map(len, ids))
    responses = torch.tensor([i + [tokenizer.pad_token_id or 0] * (width - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    batch = Batch({"responses": responses, "response_mask": mask})
    batch["data_source"] = ["t"] * 8
    batch["ground_truth"] = ["7", "12", "1", "7", "abc", "x", "3", "9"]
    cfg = RewardConfig(terms=[{"name": "exact", "path": str(tmp_path / "terms.py"), "weight": 1.0},
                              {"name": "short", "path": str(tmp_path / "terms.py"), "weight": 0.5}], max_error_rate=1.0)  # fmt: skip
    manager = RewardManager(cfg, load_plugins().registry, tokenizer)
    whole = manager.score(batch)
    parts = manager.finish(batch, [manager.evaluate(batch[0:3]), manager.evaluate(batch[3:4]), manager.evaluate(batch[4:8])])
    assert whole.metrics == parts.metrics and whole.metrics["reward/errors"] == 2.0
    for a, b in ((whole.scores, parts.scores), (whole.token_scores, parts.token_scores)):
        assert torch.equal(a, b)
    assert whole.components.keys() == parts.components.keys() and all(torch.equal(whole.components[k], parts.components[k]) for k in whole.components)


def test_a_slow_reward_scores_while_the_next_part_generates(run_rl, tmp_path):
    (tmp_path / "slow.py").write_text(SLOW)
    reward = (f"reward.path={tmp_path / 'slow.py'}", "reward.name=slow", "sampling.max_new_tokens=16", "trainer.total_steps=2")
    _, streamed = run_rl(*reward, "reward.stream_prompts=1", run_dir=tmp_path / "streamed")
    steps = [r for r in streamed if "reward/mean" in r]
    assert len(steps) == 2
    # 4 parts of 4 samples: the scoring of the first parts ran while the later ones generated
    assert all(r["timing/reward_hidden_s"] > 0 for r in steps)


def test_streaming_refuses_what_it_cannot_score_in_parts(run_rl):
    with pytest.raises(ConfigError, match="reward.stream_prompts' is 2 with trainer.partial_rollout set"):
        run_rl("reward.stream_prompts=2", "trainer.async_mode=fully_async", "trainer.partial_rollout=true", "trainer.async_schedule=opportunistic")
