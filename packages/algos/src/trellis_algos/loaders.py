"""Resumable epochs of any dataset the recipes read (prompts, SFT rows, preference pairs): a
deterministic order per epoch from ``(seed, epoch)``, resumed at the next batch from ``state_dict()``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from trellis import Batch, DataError, stream_seed


class EpochLoader:
    """Deterministic, resumable batches of item indices: epoch ``e`` uses the order drawn from
    ``(seed, e)``. ``position`` counts the batches already given in the current epoch."""

    unit = "items"
    size_key = "the batch size"  # the config key that sets it, for error messages

    def __init__(self, num_items: int, batch_size: int, seed: int, shuffle: bool, drop_last: bool) -> None:
        if batch_size <= 0:
            raise DataError(f"batch size must be positive, got {batch_size}")
        if drop_last and num_items < batch_size:
            raise DataError(f"the dataset has {num_items} {self.unit}, fewer than one batch of {batch_size}; lower {self.size_key} or add data")
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        """Batches per epoch."""
        n, b = self.num_items, self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def order(self, epoch: int) -> list[int]:
        """Item indices of ``epoch`` in the order they are served."""
        if not self.shuffle:
            return list(range(self.num_items))
        g = torch.Generator().manual_seed(stream_seed(self.seed, epoch))
        return torch.randperm(self.num_items, generator=g).tolist()

    def next_indices(self) -> tuple[list[int], int]:
        """The next batch's item indices and its epoch; advances the position (epochs roll over)."""
        if self._order_epoch != self.epoch:
            self._order, self._order_epoch = self.order(self.epoch), self.epoch
        start = self.position * self.batch_size
        indices, epoch = self._order[start : start + self.batch_size], self.epoch
        self.position += 1
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        return indices, epoch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed"}``: where the next batch comes from."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (from ``state_dict``): the next batch is the one that would have come."""
        missing = [k for k in ("epoch", "position", "seed") if k not in state]
        if missing:
            raise DataError(f"loader state {state} lacks {missing}; pass what state_dict() returned")
        if not 0 <= int(state["position"]) < max(len(self), 1) or int(state["epoch"]) < 0:
            raise DataError(
                f"loader state {state} does not fit this loader ({len(self)} batches per epoch); "
                "was the dataset or the batch size changed since it was saved?"
            )
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        self._order_epoch = -1

    def collate(self, indices: Sequence[int]) -> Batch:
        """The batch of these item indices: the loader's dataset's ``collate`` unless it lays them out itself."""
        return self.dataset.collate(indices)

    def next_batch(self) -> Batch:
        """The next batch, with ``epoch`` and ``step_in_epoch`` (its position in that epoch) in its meta."""
        position = self.position
        indices, epoch = self.next_indices()
        batch = self.collate(indices)
        batch.meta.update({"epoch": epoch, "step_in_epoch": position})
        return batch

    def __iter__(self) -> Iterator[Batch]:
        """Batches without end, epoch after epoch (``epoch`` tells which); stop by step count."""
        while True:
            yield self.next_batch()
