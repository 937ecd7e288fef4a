"""Interface of a rollout engine (kind ``rollout``): generation, weight updates, sleep/wake."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from trellis.batch import Batch


@dataclass
class SamplingParams:
    """n samples per prompt; temperature 0 (or ``greedy``) means argmax decoding."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    greedy: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Generation:
    """One sample from ``agenerate``: token ids, their log-probs and why it stopped."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"


@dataclass
class RolloutSpec:
    """What a rollout engine is built from: the model folder, its options and the tokenizer."""

    model_path: str
    options: Any
    tokenizer: Any
    seed: int = 0


def rollout_batch(
    prompts: Batch,
    params: SamplingParams,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
    response_attention: torch.Tensor | None = None,
) -> Batch:
    """The layout every engine returns, from its sampled tokens.

    prompts: the ``generate`` input (``B`` left-padded prompts). responses, response_mask,
    log_probs: ``(B*n, response_len)``, right-padded, prompt i's samples at rows i*n .. i*n+n-1.
    Returns ``prompts.repeat_interleave(n)`` plus ``prompts``, ``responses``, ``response_mask``,
    ``rollout_log_probs`` (zero where masked) and ``input_ids`` / ``attention_mask`` /
    ``position_ids`` over prompt + response; ``meta["temperature"]`` is the one the log-probs use.
    response_attention: which response tokens exist ``(B*n, response_len)``; default
    ``response_mask``. Multi-turn rollouts pass 1 on environment tokens too, whose mask is 0.
    """
    out = prompts.repeat_interleave(params.n)
    response_mask = response_mask.to(out["attention_mask"].dtype)
    attend = response_mask if response_attention is None else response_attention.to(response_mask.dtype)
    attention_mask = torch.cat([out["attention_mask"], attend], dim=1)
    out.update(
        Batch(
            {
                "prompts": out["input_ids"],
                "responses": responses,
                "response_mask": response_mask,
                "rollout_log_probs": log_probs * response_mask,
                "input_ids": torch.cat([out["input_ids"], responses], dim=1),
                "attention_mask": attention_mask,
                "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            }
        )
    )
    out.meta["temperature"] = 1.0 if params.greedy or params.temperature == 0 else params.temperature
    return out


class RolloutEngine(ABC):
    """A generation engine. Registered as a factory ``make_engine(spec) -> RolloutEngine``."""

    @abstractmethod
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample ``params.n`` responses per prompt.

        prompts: ``input_ids`` and ``attention_mask`` ``(batch, prompt_len)``, left-padded.
        Returns ``batch * n`` samples, grouped by prompt (prompt i's samples at i*n .. i*n+n-1):
        ``prompts`` ``(batch*n, prompt_len)``, ``responses``, ``response_mask``,
        ``rollout_log_probs`` ``(batch*n, response_len)`` right-padded, and ``input_ids``,
        ``attention_mask``, ``position_ids`` ``(batch*n, prompt_len + response_len)``.
        """

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """One sample for one prompt given as token ids (the multi-turn loop calls this)."""
        raise NotImplementedError(f"{type(self).__name__} has no async generation")

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights with these full tensors (Hugging Face names), in memory."""

    def sleep(self) -> None:
        """Free what generation holds (KV cache, weights) between rollouts; a no-op if unsupported."""

    def wake(self) -> None:
        """Undo ``sleep`` before the next generation."""
