"""The multi-turn invariant: every token a conversation trains on is a token the engine sampled,
in the order sampled (an agent loop that decodes and re-encodes a turn trains on ids the policy
never produced, and its log-probs belong to other tokens)."""

from __future__ import annotations

import contextvars
from typing import Any

from trellis import Generation, RolloutEngine, SamplingParams, Trajectory
from trellis.kit.multiturn import with_images

_TURNS: contextvars.ContextVar[list[Generation]] = contextvars.ContextVar("trellis_sampled_turns")


class NotSampled(RuntimeError):
    """A trajectory trains on ids its engine did not sample."""


class RecordingEngine:
    """The engine as agent loops see it: each ``agenerate`` is also kept for the sample whose
    task awaited it (:func:`recording`), to be checked against its trajectory."""

    def __init__(self, engine: RolloutEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams, images: dict | None = None) -> Generation:
        gen = await self._engine.agenerate(prompt_ids, params, **with_images(images))
        turns = _TURNS.get(None)
        if turns is not None:  # None: called outside a sample's task (nothing to check it against)
            turns.append(gen)
        return gen


def recording() -> list[Generation]:
    """A fresh record of the model turns sampled in the calling task (each sample runs as a task of its own)."""
    return record_into([])


def record_into(turns: list[Generation]) -> list[Generation]:
    """Record the calling task's ``agenerate`` calls in ``turns``: a sample's record, taken with
    :func:`current_record` in its own task, so that a task serving it (a request to the policy
    endpoint) records there too."""
    _TURNS.set(turns)
    return turns


def current_record() -> list[Generation] | None:
    """The record of the calling task's sample; None outside a sample's task."""
    return _TURNS.get(None)


def check_sampled(traj: Trajectory, turns: list[Generation], loop: str, tokenizer: Any) -> None:
    """Every mask-1 token of ``traj`` lies in a verbatim copy of one of ``turns``, taken in order
    (a turn may be dropped, or kept with mask 0), with the engine's log-probs. Raises
    :class:`NotSampled` naming the agent loop and the first trained token no turn accounts for."""
    ids, mask, lps = traj.response_ids, traj.response_mask, traj.log_probs
    trained = [(i, lp) for i, m, lp in zip(ids, mask, lps) if m]
    if trained == [(i, lp) for gen in turns for i, lp in zip(gen.token_ids, gen.log_probs)]:
        return  # every turn trained, in order: the common case, in linear time
    covered = [False] * len(ids)
    at = 0
    for gen in turns:
        k = len(gen.token_ids)
        found = [q for q in range(at, len(ids) - k + 1) if k and ids[q : q + k] == gen.token_ids]
        # a trained copy of the turn, else a copy kept with mask 0, else the turn was dropped
        start = next((q for q in found if all(mask[q : q + k])), found[0] if found else None)
        if start is None:
            continue
        for q in range(start, start + k):
            covered[q] = lps[q] == gen.log_probs[q - start] or not mask[q]
        at = start + k
    bad = next((q for q, m in enumerate(mask) if m and not covered[q]), None)
    if bad is not None:
        raise NotSampled(
            f"multi-turn: agent loop {loop!r} trains on token {ids[bad]} ({tokenizer.decode([ids[bad]])!r}) at response position "
            f"{bad}, which (with its log-prob) is not part of any model turn the engine sampled for this sample; an agent loop "
            "must keep each turn's token ids and log-probs as agenerate returned them (Trajectory.add_model), never decode and "
            "re-encode them, and give environment tokens mask 0 (Trajectory.add_environment)"
        )
