"""The ``verl_default`` reward is verl 0.9.1's own ``default_compute_score`` (imported, installed in
this session without its dependencies): a converted run scores as verl does where trellis's
``auto`` would not (an unboxed MATH answer, DAPO's -1/+1 for ``math``); without verl the converter
falls back to ``auto`` and says so, and a run naming ``verl_default`` stops before building
anything, naming the install."""

from __future__ import annotations

import sys

import pytest
from omegaconf import OmegaConf

from trellis.config import ConfigError
from trellis.plugins import load_plugins
from trellis_algos.rewards import check_reward
from trellis_verl_compat import scoring
from trellis_verl_compat.convert import convert, read_verl


@pytest.mark.parametrize(
    ("data_source", "solution", "truth", "score"),
    [
        ("openai/gsm8k", "so the answer is #### 28", "28", 1.0),
        ("openai/gsm8k", "the answer is 28", "28", 0.0),  # verl's strict GSM8K rule
        ("lighteval/MATH", "the answer is 28", "28", 0.0),  # unboxed: verl's MATH rule reads \boxed{} only
        ("lighteval/MATH", "so \\boxed{28}", "28", 1.0),
        ("math", "x", "28", -1.0),  # DAPO's rule: -1 for a wrong answer
        ("math_dapo", "Answer: 28", "28", 1.0),
        ("aime2024", "Answer: 27", "28", -1.0),
    ],
)
def test_verl_default_scores_as_verl(data_source, solution, truth, score):
    fn = load_plugins().registry.get("reward", "verl_default").obj
    result = fn(data_source=data_source, solution_str=solution, ground_truth=truth, extra_info=None)
    assert (result["score"] if isinstance(result, dict) else result) == score


def test_conversion_scores_with_verl_where_it_is_installed(monkeypatch):
    given = ["actor_rollout_ref.model.path=/m", "trainer.total_training_steps=2"]
    assert convert(read_verl(given)).config["reward"] == {"name": "verl_default"}
    monkeypatch.setattr(scoring, "available", lambda: False)
    conversion = convert(read_verl(given))
    assert conversion.config["reward"] == {"name": "auto"}
    assert "math-verify takes an unboxed answer" in conversion.notes[0] and scoring.INSTALL in conversion.notes[0]


def test_a_run_naming_verl_default_without_verl_stops_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl.utils.reward_score", None)  # import fails as if verl were absent
    scoring._default_compute_score.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"reward 'verl_default' is not ready: .*pip install --no-deps verl==0.9.1"):
            check_reward(OmegaConf.create({"name": "verl_default"}), load_plugins().registry, "rl")
    finally:
        scoring._default_compute_score.cache_clear()
