"""What a rollout ships to its engines: the prompt fields the engine declares (``model_inputs``),
nothing more; the other fields stay with the rollout and are repeated onto each prompt's samples."""

from __future__ import annotations

import torch

from trellis.batch import Batch
from trellis.interfaces.backend import MODEL_INPUTS
from trellis.interfaces.rollout import RolloutEngine, SamplingParams, rollout_batch
from trellis.runtime.controller import LocalRollout


class Recording(RolloutEngine):
    """Answers every prompt with two tokens and records the fields it was given."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self.seen.append(sorted(prompts.keys()))
        rows = len(prompts) * params.n
        ones = torch.ones(rows, 2, dtype=torch.long)
        return rollout_batch(prompts, params, ones, ones, torch.zeros(rows, 2))

    def load_weights(self, weights, shapes=None) -> None:
        pass


class Seeing(Recording):
    model_inputs = (*MODEL_INPUTS, "pixel_values")


def prompts() -> Batch:
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    tensors = {"input_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]), "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1}
    return Batch({**tensors, "pixel_values": torch.tensor([[0.5, 0.25], [1.0, 2.0]])}, {"data_source": ["a", "b"]})


def test_an_engine_gets_the_fields_it_declares_and_the_samples_keep_the_rest():
    params = SamplingParams(n=2, max_new_tokens=2)
    for engine, shipped in ((Recording(), sorted(MODEL_INPUTS)), (Seeing(), sorted((*MODEL_INPUTS, "pixel_values")))):
        out = LocalRollout(engine, actor=None).generate(prompts(), params)
        assert engine.seen == [shipped]
        assert list(out["data_source"]) == ["a", "a", "b", "b"]
        assert torch.equal(out["pixel_values"], prompts()["pixel_values"].repeat_interleave(2, 0))
