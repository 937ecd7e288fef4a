"""Scoring while generating (``reward.stream_prompts``): each part of a step's prompts is scored on
a thread of its own while the next part generates, so the reward stage hides behind generation."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from trellis import Batch, RewardResult, RolloutGroup, SamplingParams
from trellis.kit.recipe import StageTimer
from trellis_algos.rewards import RewardManager


def generate_scored(
    rollout: RolloutGroup, prompts: Batch, params: SamplingParams, reward_fn: RewardManager, size: int, timer: StageTimer
) -> tuple[Batch, RewardResult]:
    """The samples of ``prompts`` (generated ``size`` prompts at a time) and their reward, equal to
    scoring the whole batch at once. ``timing/gen_s``: the generation; ``timing/reward_s``: the
    scoring left once generation ended; ``timing/reward_hidden_s``: the scoring that ran while
    the engines generated."""
    parts: list[Batch] = []
    pending = []
    busy = 0.0

    def evaluate(part: Batch):
        nonlocal busy
        start = time.perf_counter()
        out = reward_fn.evaluate(part)
        busy += time.perf_counter() - start
        return out

    with ThreadPoolExecutor(1, thread_name_prefix="trellis-reward-stream") as pool:
        with timer("gen"):
            for part in rollout.stream(prompts, params, size):
                parts.append(part)
                pending.append(pool.submit(evaluate, part))
        exposed = time.perf_counter()
        with timer("reward"):
            evaluations = [f.result() for f in pending]
        exposed = time.perf_counter() - exposed
    timer.add("reward_hidden", max(busy - exposed, 0.0))
    batch = Batch.cat(parts, pad=True)
    return batch, reward_fn.finish(batch, evaluations)
