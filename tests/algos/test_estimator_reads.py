"""An advantage estimator reads batch fields as the step's batch holds them (``reads``, open to any
field a rollout records): the rl step hands them over in ``AdvantageInputs.fields`` and nothing
else; a field the samples lack stops the step, naming it. The need set stays closed and checked."""

from __future__ import annotations

import pytest
import torch

from trellis.batch import Batch
from trellis.registry import Registry
from trellis_algos.rl.learner import compute_advantages


def turns_over_group_mean(data, options):
    """Each sample's count of turns minus its group's mean, on every generated token."""
    turns = torch.tensor([float(len(scores)) for scores in data.fields["turn_scores"]])
    groups = data.group_ids
    means = torch.zeros(int(groups.max()) + 1).index_add(0, groups, turns) / torch.bincount(groups).float()
    advantages = (turns - means[groups])[:, None] * data.response_mask
    return advantages, advantages


turns_over_group_mean.reads = ("turn_scores",)


def samples(**fields) -> Batch:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    return Batch({"token_scores": torch.zeros(4, 3), "response_mask": mask}, {"uid": ["a", "a", "b", "b"], **fields})


def test_an_estimator_gets_the_batch_fields_it_reads_and_no_others():
    registry = Registry()
    registry.add("advantage", "turns", turns_over_group_mean)
    reads = registry.get("advantage", "turns").declared["reads"]
    batch = samples(turn_scores=[[1.0], [0.0, 1.0, 1.0], [0.5, 0.5], [1.0, 0.0]], interaction=["x"] * 4)
    seen = []
    compute_advantages(batch, lambda data, options: (seen.append(data.fields), turns_over_group_mean(data, options))[1], None, None, (), reads)
    assert list(seen[0]) == ["turn_scores"]  # interaction is in the batch but not read
    # group a: turns 1 and 3 (mean 2); group b: 2 and 2
    assert batch["advantages"].tolist() == [[-1.0, -1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_a_field_the_samples_lack_stops_the_step_naming_it():
    with pytest.raises(ValueError, match=r"reads batch fields \['turn_scores'\], which this run's samples do not hold"):
        compute_advantages(samples(), turns_over_group_mean, None, None, (), ("turn_scores",))
