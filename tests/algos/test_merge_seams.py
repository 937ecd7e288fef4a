"""Every seam that merges rollout batches (dispatch gather, dynamic sampling's rounds and carried
groups, streamed parts, partial rollouts' chunks) keeps each response where the trainer reads it
when prompts differ in width: the engines here trim their prompts' left padding, so each returns
its own prompt width, as engines of other ranks or rounds do."""

from __future__ import annotations

import torch
from rollouts import rollout_round

from trellis.batch import Batch
from trellis.data import left_pad
from trellis.interfaces.dispatch import DP_CHUNKS, Mesh, Route
from trellis.interfaces.rollout import RolloutEngine, SamplingParams, samples_batch
from trellis.rewards import RewardResult
from trellis.runtime.controller import LocalRollout, WorkerGroup
from trellis.runtime.harness import StageTimer
from trellis_algos.rl.dynamic_sampling import DynamicSamplingConfig, fill
from trellis_algos.rl.invariants import check_alignment
from trellis_algos.rl.partial import generate_in_chunks
from trellis_algos.rl.streaming import generate_scored

PROMPTS = [[5], [6, 7, 8, 9], [10, 11], [12, 13, 14]]


def answer(prompt: list[int], asked: int) -> list[int]:
    """A response that depends on the prompt: its length is the prompt's (cut at ``asked``), then 2."""
    return ([t + 100 for t in prompt] + [2])[:asked]


class TrimmingEngine(RolloutEngine):
    """Stand-in engine: drops its prompts' common left padding (returns its own prompt width) and
    answers :func:`answer` to each, every token with log-prob -0.5."""

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompts["input_ids"], prompts["attention_mask"])]
        ids, mask, pos = left_pad(rows, 0)
        tokens = [answer(r, params.max_new_tokens) for r in rows for _ in range(params.n)]
        trimmed = Batch({"input_ids": ids, "attention_mask": mask, "position_ids": pos})
        return samples_batch(trimmed, params, tokens, [[-0.5] * len(t) for t in tokens], 0)

    def load_weights(self, weights, shapes=None) -> None:
        raise NotImplementedError


def prompts_batch(rows: list[list[int]]) -> Batch:
    ids, mask, pos = left_pad(rows, 0)
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, {"uid": [f"p{i}" for i in range(len(rows))]})


def assert_samples(batch: Batch, prompts: list[list[int]], asked: int = 8) -> None:
    """Each row holds its prompt then its answer, the response is the last columns, and the
    log-probs sit on the response tokens."""
    check_alignment(batch, step=1)
    for i, prompt in enumerate(prompts):
        want = answer(prompt, asked)
        assert batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist() == prompt + want
        assert batch["rollout_log_probs"][i].tolist() == [-0.5] * len(want) + [0.0] * (batch["responses"].shape[1] - len(want))


class SimulatedRanks(WorkerGroup):
    """Each data-parallel 'rank' runs its own engine in this process."""

    def _execute(self, method, per_rank_args, kwargs):
        return [TrimmingEngine().generate(*args) if len(args[0]) else Batch() for args in per_rank_args]


def test_dispatch_gathers_ranks_of_other_prompt_widths():
    group = SimulatedRanks("rollout", Mesh(dp=2), {"generate": Route(DP_CHUNKS)})
    out = group.generate(prompts_batch([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]]), SamplingParams(max_new_tokens=8))
    assert_samples(out, [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]])  # rank 0 widths 1-2, rank 1 widths 3-4


def test_dynamic_sampling_rounds_and_carried_groups_of_other_prompt_widths():
    def round_at(r: int):
        batch = rollout_round([PROMPTS[r], PROMPTS[r]], [answer(PROMPTS[r], 8)] * 2, first_uid=10 * r)
        batch["uid"] = [f"r{r}"] * 2
        batch["rollout_log_probs"] = -0.5 * batch["response_mask"]
        scores = torch.tensor([0.0, 1.0])
        return batch, RewardResult(torch.zeros(2, batch["responses"].shape[1]), {}, scores, {})

    carried = [round_at(3)]
    out = fill(round_at, 3, DynamicSamplingConfig(enable=True), step=1, carried=carried)
    assert out.batch["uid"].tolist() == ["r3", "r3", "r0", "r0", "r1", "r1"]
    assert_samples(out.batch, [PROMPTS[3]] * 2 + [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2)


class PartsReward:
    """Stand-in reward: a part's evaluation is its samples' response lengths."""

    def evaluate(self, part: Batch) -> torch.Tensor:
        return part["response_mask"].sum(-1).float()

    def finish(self, batch: Batch, parts: list[torch.Tensor]) -> RewardResult:
        return RewardResult(torch.zeros_like(batch["response_mask"], dtype=torch.float), {}, torch.cat(parts), {})


def test_streamed_parts_of_other_prompt_widths():
    rollout = LocalRollout(TrimmingEngine(), None)
    batch, scored = generate_scored(rollout, prompts_batch(PROMPTS), SamplingParams(max_new_tokens=8), PartsReward(), 1, StageTimer())
    assert_samples(batch, PROMPTS)
    assert scored.scores.tolist() == [len(answer(p, 8)) for p in PROMPTS]


def test_partial_rollout_chunks_of_other_prompt_widths():
    rollout = LocalRollout(TrimmingEngine(), None)
    out = generate_in_chunks(rollout, prompts_batch(PROMPTS), SamplingParams(max_new_tokens=8), 2, {2}, 0, lambda: None)
    # each chunk answers afresh from prompt + tokens so far: the engine's answer to the longer prompt
    for i, prompt in enumerate(PROMPTS):
        tokens = out["responses"][i][out["response_mask"][i].bool()].tolist()
        assert out["input_ids"][i][out["attention_mask"][i].bool()].tolist() == prompt + tokens
    check_alignment(out, step=1)
