"""Partial rollouts (``trainer.partial_rollout``): a generation runs in chunks of new tokens, and a
weight sync waiting for the engines goes in between two chunks; the unfinished samples then continue
from their tokens so far under the new weights, and every token records the version it came from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection

import torch

from trellis import Batch, RolloutGroup, SamplingParams, rollout_batch
from trellis.kit.recipe import left_pad


@dataclasses.dataclass
class Sample:
    """One sample's tokens so far, with their log-probs and weight versions."""

    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    done: bool = False

    def extend(self, tokens: list[int], log_probs: list[float], version: int, asked: int, stops: Collection[int]) -> None:
        """Add a chunk of ``asked`` tokens at most; the sample is done when the chunk stopped early
        or on a stop token."""
        self.tokens += tokens
        self.log_probs += log_probs
        self.versions += [version] * len(tokens)
        self.done = len(tokens) < asked or (bool(tokens) and tokens[-1] in stops)


def generate_in_chunks(
    rollout: RolloutGroup,
    prompts: Batch,
    params: SamplingParams,
    chunk: int,
    stops: Collection[int],
    pad: int,
    between: Callable[[], None],
) -> Batch:
    """``rollout.generate(prompts, params)`` done ``chunk`` new tokens at a time, calling
    ``between()`` before every chunk after the first (where a waiting weight sync goes in).

    prompts: left-padded ``input_ids`` / ``attention_mask`` ``(batch, prompt_len)`` and the fields
    repeated onto the samples. stops: the token ids a sample ends on (the engine's). Returns the
    layout of ``generate`` plus ``token_versions`` ``(batch*n, response_len)`` (each token's weight
    version, 0 on padding) and ``weight_version`` ``(batch*n,)``: a sample's oldest version."""
    mask = prompts["attention_mask"].bool()
    rows = [ids[m].tolist() for ids, m in zip(prompts["input_ids"], mask)]
    samples = [Sample(list(row)) for row in rows for _ in range(params.n)]
    first = rollout.generate(prompts, _at_most(params, chunk))
    _add(samples, range(len(samples)), first, chunk, stops)
    rounds = 0
    while True:
        todo = [i for i, s in enumerate(samples) if not s.done and len(s.tokens) < params.max_new_tokens]
        if not todo:
            break
        between()
        rounds += 1
        ids, attention, positions = left_pad([samples[i].prompt + samples[i].tokens for i in todo], pad)
        batch = Batch({"input_ids": ids, "attention_mask": attention, "position_ids": positions})
        asked = min(chunk, params.max_new_tokens - min(len(samples[i].tokens) for i in todo))
        # one sample per row from here; seeds move past every earlier call's
        step = dataclasses.replace(_at_most(params, asked), n=1).skip(rounds * len(samples))
        out = rollout.generate(batch, step)
        _add(samples, todo, out, asked, stops, limit=params.max_new_tokens)
    width = max((len(s.tokens) for s in samples), default=0)
    responses = torch.full((len(samples), width), pad, dtype=prompts["input_ids"].dtype)
    log_probs = torch.zeros(len(samples), width)
    versions = torch.zeros(len(samples), width, dtype=torch.long)
    response_mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        k = len(s.tokens)
        responses[i, :k] = torch.tensor(s.tokens, dtype=responses.dtype)
        log_probs[i, :k] = torch.tensor(s.log_probs)
        versions[i, :k] = torch.tensor(s.versions, dtype=torch.long)
        response_mask[i, :k] = 1
    out = rollout_batch(prompts, params, responses, response_mask, log_probs)
    out["token_versions"] = versions
    out["weight_version"] = torch.tensor([min(s.versions, default=rollout.version) for s in samples], dtype=torch.long)
    return out


def _at_most(params: SamplingParams, tokens: int) -> SamplingParams:
    return dataclasses.replace(params, max_new_tokens=min(tokens, params.max_new_tokens))


def _add(samples: list[Sample], rows, out: Batch, asked: int, stops: Collection[int], limit: int | None = None) -> None:
    """Each generated row's tokens onto its sample (``rows``: the samples the rows continue)."""
    for row, i in enumerate(rows):
        kept = out["response_mask"][row].bool()
        tokens = out["responses"][row][kept].tolist()
        if limit is not None:
            tokens = tokens[: limit - len(samples[i].tokens)]
        lps = out["rollout_log_probs"][row][kept].tolist()[: len(tokens)]
        samples[i].extend(tokens, lps, int(out["weight_version"][row]), asked, stops)


def version_span(batch: Batch) -> dict[str, float]:
    """``rollout/version_span_mean|max``: how many weight versions a sample's tokens span (0: one
    version), and ``rollout/partial_frac``: the share of samples continued after a sync."""
    mask = batch["response_mask"].bool()
    versions = batch["token_versions"]
    high = versions.masked_fill(~mask, torch.iinfo(versions.dtype).min).amax(-1)
    span = (high - batch["weight_version"]).clamp(min=0).float()
    return {
        "rollout/version_span_mean": float(span.mean()),
        "rollout/version_span_max": float(span.max()),
        "rollout/partial_frac": float((span > 0).float().mean()),
    }
