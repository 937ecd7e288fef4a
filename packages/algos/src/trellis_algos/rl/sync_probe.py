"""The check after every weight sync: each rollout engine's log-probs of a fixed probe must equal
the trainer's, else the run stops naming the engine (a sync that silently kept old weights)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trellis import IMAGE_INPUTS, Batch, RolloutGroup, SamplingParams, SyncCheckFailed, WorkerGroup, position_ids, ranged
from trellis.kit.recipe import PROMPT_IMAGES, first_images
from trellis_algos.rl.invariants import describe, gap_bound


@dataclass
class SyncCheckConfig:
    """After every weight sync each engine samples ``tokens`` greedy tokens of a fixed prompt (the
    first training prompt) and the trainer scores them: ``sync/probe_gap`` is the largest per-engine
    mean |engine - trainer| log-prob. Above ``max_gap`` the run stops, naming the engine.
    Every step, the same gap over the batch's response tokens (``sync/batch_gap``, the samples the
    current weights generated; ``trellis_algos.rl.invariants``) must stay under ``max_batch_gap``.
    Both bounds, when None, come from the lower precision of the trainer's compute dtype and the
    engines' weight dtype: 1e-3 when both are float32 (1e-4 for the batch when the engine generates
    from the actor's own module), 0.1 when either is 16-bit or unknown."""

    enable: bool = True
    max_gap: float | None = ranged(None, gt=0)
    max_batch_gap: float | None = ranged(None, gt=0)
    tokens: int = ranged(4, ge=1)


def _prompt_images_of(batch: Batch, i: int) -> dict:
    """Sample ``i``'s prompt's images: its ``IMAGE_INPUTS`` without those a conversation's tools returned (``PROMPT_IMAGES``)."""
    images = batch[IMAGE_INPUTS][i]
    return first_images(images, batch[PROMPT_IMAGES][i]) if PROMPT_IMAGES in batch else images


class SyncProbe:
    """Holds the probe prompt and checks one sync at a time (:meth:`check`)."""

    def __init__(self, options: SyncCheckConfig, rollout: RolloutGroup, params: SamplingParams, trainer_dtype: torch.dtype | None) -> None:
        self.options = options
        self.rollout = rollout
        self.params = SamplingParams(n=1, greedy=True, max_new_tokens=options.tokens, stop_token_ids=list(params.stop_token_ids))
        self.max_gap = options.max_gap or gap_bound(trainer_dtype, rollout.weight_dtype)
        self.sides = describe(trainer_dtype, rollout.weight_dtype, False)
        self.prompt: Batch | None = None

    def state_dict(self) -> dict:
        """The probe prompt, for checkpoints: a resumed run probes with the prompt it started with."""
        return {"prompt": None if self.prompt is None else self.prompt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.prompt = None if state["prompt"] is None else Batch.from_state_dict(state["prompt"])

    @property
    def active(self) -> bool:
        """Off when disabled, or when the engine generates from the actor's own module (nothing to sync)."""
        return self.options.enable and not self.rollout.shared

    def check(self, actor: WorkerGroup, batch: Batch, step: int) -> dict[str, float]:
        """``{"sync/probe_gap": ...}`` after the sync of ``step``; the first call fixes the probe to
        the prompt of ``batch``'s first sample with images if it has any (the vision tower's weights
        then count), else its first (``prompts`` ``(batch, prompt_len)``, left-padded).
        Raises :class:`SyncCheckFailed` naming the engine above ``max_gap``."""
        if not self.active:
            return {}
        if self.prompt is None:
            first = next((i for i, images in enumerate(batch.get(IMAGE_INPUTS, ())) if images), 0)
            width = batch["prompts"].shape[1]
            mask = batch["attention_mask"][first : first + 1, :width]
            images = {IMAGE_INPUTS: [_prompt_images_of(batch, first)]} if IMAGE_INPUTS in batch else {}
            self.prompt = Batch(
                {"input_ids": batch["prompts"][first : first + 1], "attention_mask": mask, "position_ids": position_ids(mask)}, images
            )
        engines = self.rollout.engines
        # one copy per engine: the rollout deals prompts to its engines in contiguous chunks
        sampled = self.rollout.generate(self.prompt[[0] * engines], self.params)
        trainer = actor.log_prob(sampled)["log_probs"]
        mask = sampled["response_mask"].float()
        gaps = ((sampled["rollout_log_probs"] - trainer).abs() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        worst = int(gaps.argmax())
        if float(gaps[worst]) > self.max_gap:
            raise SyncCheckFailed(
                f"step {step}: after the weight sync, rollout engine {worst} of {engines} ({self.rollout.engine_name}) gives the "
                f"probe's tokens log-probs {float(gaps[worst]):.3g} apart from the trainer's on average (sync_check.max_gap="
                f"{self.max_gap:g}; {self.sides}): the engine is not sampling from the weights being trained. Check the engine's weight "
                "loading (the names and dtype it receives); if the gap is only numerical (e.g. another dtype), raise "
                "sync_check.max_gap"
            )
        return {"sync/probe_gap": float(gaps.max())}
