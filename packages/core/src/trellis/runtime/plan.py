"""The batch plan of a role: how a step's samples are cut into epochs, mini-batches (one optimizer
step each) and micro-batches (one forward/backward each), made once, outside the backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trellis.batch import Batch


@dataclass(frozen=True)
class Plan:
    """epochs: passes over the step's samples. mini_batch_samples: samples per optimizer step over
    all data-parallel ranks (0: the whole step). micro_batch_samples: samples per forward (0: the
    whole mini-batch). max_tokens_per_micro_batch: if > 0, micro-batches are cut by this
    padded-token budget instead (dynamic batching). shuffle: reorder samples each epoch."""

    epochs: int = 1
    mini_batch_samples: int = 0
    micro_batch_samples: int = 0
    max_tokens_per_micro_batch: int = 0
    shuffle: bool = False

    @staticmethod
    def of(options: Any) -> Plan:
        """The plan a role's options describe (``BatchingConfig`` fields; absent ones default)."""
        if options is None:
            return Plan()
        return Plan(
            epochs=getattr(options, "ppo_epochs", 1),
            mini_batch_samples=getattr(options, "mini_batch_samples", 0),
            micro_batch_samples=getattr(options, "micro_batch_samples", 0),
            max_tokens_per_micro_batch=getattr(options, "max_tokens_per_micro_batch", 0),
            shuffle=getattr(options, "shuffle", False),
        )

    def mini_batches(self, batch: Batch, dp_size: int, epoch: int, seed: int) -> list[Batch]:
        """This rank's part of each mini-batch of ``epoch``. ``batch`` is this rank's share of the
        step (dealt strided over ``dp_size`` ranks); ``seed`` fixes the shuffle."""
        if self.shuffle:
            gen = torch.Generator().manual_seed(seed + epoch)
            batch = batch.reorder(torch.randperm(len(batch), generator=gen))
        if self.mini_batch_samples and self.mini_batch_samples % dp_size:
            raise ValueError(f"mini_batch_samples={self.mini_batch_samples} must divide by the {dp_size} data-parallel ranks")
        size = self.mini_batch_samples // dp_size if self.mini_batch_samples else len(batch)
        return batch.split(max(size, 1))

    def one_update(self, samples: int) -> bool:
        """Whether a step of ``samples`` samples (over all ranks) gets exactly one optimizer step."""
        return self.epochs == 1 and self.mini_batch_samples in (0, samples)

    def length_order(self, batch: Batch, mask_key: str = "attention_mask") -> torch.Tensor | None:
        """With a token budget, the order of ``batch``'s samples longest first (by the columns each
        spans in ``mask_key``), so that cut in this order each micro-batch holds samples of about
        one length and little padding, as verl's dynamic batching balances them; None without
        a budget (micro-batches keep the batch's order)."""
        if self.max_tokens_per_micro_batch <= 0 or mask_key not in batch:
            return None
        first, last = batch.attended_columns(mask_key)
        return torch.argsort(last - first, descending=True, stable=True)

    def micro_batches(self, batch: Batch, mask_key: str = "attention_mask") -> list[Batch]:
        """Micro-batches of ``micro_batch_samples``, or by token budget over ``mask_key`` (of
        consecutive samples: put them in :meth:`length_order` first); the columns that are
        padding in all of a micro-batch's samples are cut (``Batch.trim_padding``)."""
        if self.max_tokens_per_micro_batch > 0 and mask_key in batch:
            micros = batch.split_by_tokens(self.max_tokens_per_micro_batch, mask_key)
        else:
            micros = batch.split(self.micro_batch_samples or max(len(batch), 1))
        return [m.trim_padding(mask_key) if mask_key in m else m for m in micros]
