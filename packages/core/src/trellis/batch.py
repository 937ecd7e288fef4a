"""``Batch``: per-sample tensors and per-sample Python fields that move together.

Tensors live in a ``tensordict.TensorDict`` (batch dimension 0); strings, dicts and other
Python values live in numpy object arrays of the same length. Every operation that reorders,
splits or repeats samples applies one index to both, so they never drift apart. ``meta`` holds
batch-level values (sampling temperature, global token counts) that are not per sample.
Also the rules every module reads a mask by: :func:`position_ids`, :func:`last_valid_index`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``(batch, seq_len)`` positions of the attended tokens, counted from 0 in each row
    (``cumsum(attention_mask) - 1``); padding gets 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """``(batch,)`` long: the column of the last nonzero entry of each row of ``mask`` ``(batch, len)``,
    -1 for a row with none."""
    columns = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
    return torch.where(mask.bool(), columns, -1).max(-1).values if mask.shape[1] else torch.full(mask.shape[:1], -1, device=mask.device)


class Batch:
    """A batch of samples. ``len(batch)`` is the number of samples.

    >>> b = Batch({"input_ids": torch.zeros(4, 7, dtype=torch.long)}, {"data_source": ["a"] * 4})
    >>> len(b.repeat_interleave(2))
    8
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor] | TensorDict | None = None,
        non_tensors: dict[str, Sequence[Any] | np.ndarray] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        tensors = tensors if tensors is not None else {}
        non_tensors = {k: _object_array(v) for k, v in (non_tensors or {}).items()}
        sizes = {k: len(t) for k, t in tensors.items()} | {k: len(v) for k, v in non_tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the number of samples: {sizes}")
        n = next(iter(sizes.values()), 0)
        self.tensors = tensors if isinstance(tensors, TensorDict) else TensorDict(dict(tensors), batch_size=[n])
        self.non_tensors: dict[str, np.ndarray] = non_tensors
        self.meta: dict[str, Any] = dict(meta or {})

    # -- access ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.tensors.batch_size[0]) if self.tensors.batch_size else 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors.keys() or key in self.non_tensors

    def __getitem__(self, key: str | int | slice | torch.Tensor | np.ndarray | Sequence[int]) -> Any:
        """A field by name, or a sub-batch by index, slice, boolean mask or index list."""
        if isinstance(key, str):
            if key in self.non_tensors:
                return self.non_tensors[key]
            if key in self.tensors.keys():
                return self.tensors[key]
            raise KeyError(f"Batch has no field {key!r}; fields: {sorted(self.keys())}")
        if isinstance(key, int):
            key = [key]
        index = _as_index(key, len(self))
        return Batch(self.tensors[index], {k: v[index.numpy()] for k, v in self.non_tensors.items()}, self.meta)

    def __setitem__(self, key: str, value: torch.Tensor | Sequence[Any]) -> None:
        if len(value) != len(self) and len(self.keys()) > 0:
            raise ValueError(f"field {key!r} has {len(value)} samples, the batch has {len(self)}")
        if isinstance(value, torch.Tensor):
            if not self.keys():
                self.tensors = TensorDict({}, batch_size=[len(value)])
            self.tensors[key] = value
        else:
            self.non_tensors[key] = _object_array(value)

    def keys(self) -> list[str]:
        return [*self.tensors.keys(), *self.non_tensors]

    def state_dict(self) -> dict[str, Any]:
        """The batch in the types ``torch.load(weights_only=True)`` reads back (tensors, lists,
        dicts, strings, numbers), for a checkpoint; numpy values in its Python fields become
        lists and numbers. :meth:`from_state_dict` rebuilds it."""
        return {"tensors": dict(self.tensors.items()), "non_tensors": {k: _plain(v) for k, v in self.non_tensors.items()}, "meta": _plain(self.meta)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Batch:
        return cls(state["tensors"], state["non_tensors"], state["meta"])

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def select(self, *keys: str) -> Batch:
        """A batch with only ``keys`` (tensors and non-tensors alike); meta is kept."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no field(s) {missing}; fields: {sorted(self.keys())}")
        tensor_keys = [k for k in keys if k in self.tensors.keys()]
        return Batch(
            self.tensors.select(*tensor_keys) if tensor_keys else TensorDict({}, batch_size=[len(self)]),
            {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
            self.meta,
        )

    def update(self, other: Batch) -> Batch:
        """Add (or replace) ``other``'s fields and meta, sample for sample. Returns self."""
        if len(other) != len(self):
            raise ValueError(f"cannot merge a batch of {len(other)} samples into one of {len(self)}")
        for k in other.tensors.keys():
            self.tensors[k] = other.tensors[k]
        self.non_tensors.update(other.non_tensors)
        self.meta.update(other.meta)
        return self

    def group_index(self, key: str) -> torch.Tensor:
        """``(batch,)`` int64 group ids: samples with equal values of field ``key`` (e.g. the
        prompt ``uid``) share an id, numbered in order of first appearance."""
        ids: dict[Any, int] = {}
        return torch.tensor([ids.setdefault(v, len(ids)) for v in self[key].tolist()], dtype=torch.long)

    # -- reshaping -------------------------------------------------------------------------
    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of ``size`` samples (the last may be smaller)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self[torch.arange(i, min(i + size, len(self)))] for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list[Batch]:
        """``n`` consecutive chunks of equal size; ``len(self)`` must divide by ``n``."""
        if n <= 0 or len(self) % n:
            raise ValueError(f"cannot cut a batch of {len(self)} samples into {n} equal chunks")
        return self.split(len(self) // n)

    def repeat_interleave(self, n: int) -> Batch:
        """Each sample repeated ``n`` times in place: a b -> a a b b (n samples per prompt)."""
        return self[torch.arange(len(self)).repeat_interleave(n)]

    def reorder(self, order: torch.Tensor | Sequence[int]) -> Batch:
        """The samples in ``order`` (a permutation)."""
        order = torch.as_tensor(order)
        if sorted(order.tolist()) != list(range(len(self))):
            raise ValueError("reorder needs a permutation of all sample indices")
        return self[order]

    @staticmethod
    def cat(batches: Iterable[Batch], pad: bool = False) -> Batch:
        """Samples of all ``batches`` one after another; fields must match. Meta of the first.

        ``pad``: tensors of a field may differ in their width (dimension 1: e.g. responses generated
        on different ranks, rounds of prompts of other lengths); the zeros padded in are masked, so
        never read as tokens. Batches in the rollout layout (``input_ids`` and ``responses``) are
        padded by :func:`rollout_padded`, side by side (the prompt left, the response right),
        so the last ``response_len`` columns stay the response; other fields are right-padded.
        """
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.cat needs at least one batch")
        keys = set(batches[0].keys())
        for b in batches[1:]:
            if set(b.keys()) != keys:
                raise ValueError(f"cannot concatenate batches with different fields: {sorted(keys)} vs {sorted(b.keys())}")
        if pad:
            batches = rollout_padded(batches) if all(_is_rollout(b) for b in batches) else _right_padded(batches)
        tensors = torch.cat([b.tensors for b in batches]) if batches[0].tensors.keys() else TensorDict({}, batch_size=[sum(len(b) for b in batches)])
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in batches[0].non_tensors}
        return Batch(tensors, non_tensors, batches[0].meta)

    # -- padding-aware selection -------------------------------------------------------------
    def token_counts(self, mask_key: str) -> torch.Tensor:
        """Valid tokens per sample, ``(batch,)``, from a 0/1 mask ``(batch, seq_len)``."""
        return self.tensors[mask_key].sum(-1)

    def trim_padding(self, mask_key: str = "attention_mask", response_key: str = "responses") -> Batch:
        """Cut the columns that are padding in every sample, so a micro-batch computes on no more
        columns than it needs: leading and trailing ones of every ``(batch, seq_len)`` field (the
        width of ``mask_key``), and, when ``response_key`` ``(batch, response_len)`` is present, the
        same trailing ones of every ``(batch, response_len)`` field (responses end the sequence;
        one response column is always kept)."""
        mask = self.tensors[mask_key]
        width = mask.shape[1]
        used = mask.any(0).nonzero().flatten()
        if used.numel() == 0:
            return self
        lo, hi = int(used[0]), int(used[-1]) + 1
        response_width = self.tensors[response_key].shape[1] if response_key in self.tensors.keys() else None
        if response_width is not None:
            hi = width - min(width - hi, response_width - 1)
            lo = min(lo, width - response_width)
        if (lo, hi) == (0, width):
            return self
        tensors = {}
        for k, t in self.tensors.items():
            if t.dim() >= 2 and t.shape[1] == width:
                t = t[:, lo:hi]
            elif response_width is not None and t.dim() >= 2 and t.shape[1] == response_width:
                t = t[:, : response_width - (width - hi)]
            tensors[k] = t
        return Batch(tensors, self.non_tensors, self.meta)

    def attended_columns(self, mask_key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample's first and last attended column of ``mask_key``, ``(batch,)`` each (0 and
        -1 for a sample with none): the columns it spans."""
        mask = self.tensors[mask_key].bool()
        columns = torch.arange(mask.shape[1])
        first = torch.where(mask, columns, mask.shape[1]).min(-1).values.masked_fill(~mask.any(-1), 0)
        return first, last_valid_index(mask)

    def split_by_tokens(self, max_tokens: int, mask_key: str) -> list[Batch]:
        """Micro-batches of consecutive samples whose padded size (samples x the columns they span
        once :meth:`trim_padding` cuts the all-padding ones) stays within ``max_tokens`` (dynamic
        batching). A sample longer than the budget gets a micro-batch alone."""
        first, last = (t.tolist() for t in self.attended_columns(mask_key))
        groups: list[list[int]] = [[]]
        lo, hi = 0, -1
        for i, (a, b) in enumerate(zip(first, last)):
            new_lo, new_hi = (min(lo, a), max(hi, b)) if groups[-1] else (a, b)
            if groups[-1] and (new_hi - new_lo + 1) * (len(groups[-1]) + 1) > max_tokens:
                groups.append([])
                new_lo, new_hi = a, b
            groups[-1].append(i)
            lo, hi = new_lo, new_hi
        return [self[torch.tensor(g)] for g in groups if g]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.tensors.to(device), self.non_tensors, self.meta)

    def __repr__(self) -> str:
        t = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in self.tensors.items())
        return f"Batch(n={len(self)}, tensors={{{t}}}, non_tensors={sorted(self.non_tensors)})"


def _right_padded(batches: list[Batch]) -> list[Batch]:
    """Each field of ``batches`` of two or more dimensions right-padded with zeros to its widest."""
    widths = {k: max(b.tensors[k].shape[1] for b in batches) for k in batches[0].tensors.keys() if batches[0].tensors[k].dim() > 1}
    return [
        Batch({k: pad_columns(t, 0, widths[k] - t.shape[1]) if k in widths else t for k, t in b.tensors.items()}, b.non_tensors, b.meta)
        for b in batches
    ]


# rollout-layout fields that hold the prompt alone, left-padded ``(batch, prompt_len)``; and the model
# inputs over prompt + response, named for a batch without prompt tokens (the two widths are one)
PROMPT_SIDE = ("prompts",)
SEQUENCE_SIDE = ("input_ids", "attention_mask", "position_ids")


def _is_rollout(batch: Batch) -> bool:
    return "input_ids" in batch.tensors.keys() and "responses" in batch.tensors.keys()


def rollout_padded(batches: list[Batch]) -> list[Batch]:
    """``batches`` in the rollout layout (each sample's prompt left-padded to its batch's longest,
    then its response right-padded: ``(batch, prompt_len + response_len)`` fields such as
    ``input_ids``, ``(batch, response_len)`` fields such as ``responses``), padded to one width:
    the prompt side of each field on the left to the longest prompt, the response side on the
    right to the longest response, ``position_ids`` recomputed from the attention mask. Every
    batch keeps the rule the trainer reads samples by: the response is the last
    ``response_len`` columns of ``input_ids``. A field of another width is refused by name."""
    prompt = max(_prompt_len(b) for b in batches)
    response = max(b.tensors["responses"].shape[1] for b in batches)
    out = []
    for b in batches:
        p, r = _prompt_len(b), b.tensors["responses"].shape[1]
        tensors = {}
        for k, t in b.tensors.items():
            if t.dim() < 2:
                tensors[k] = t
            elif k in PROMPT_SIDE:
                tensors[k] = pad_columns(t, prompt - t.shape[1], 0)
            elif t.shape[1] == p + r and (p or k in SEQUENCE_SIDE):
                tensors[k] = torch.cat([pad_columns(t[:, :p], prompt - p, 0), pad_columns(t[:, p:], 0, response - r)], dim=1)
            elif t.shape[1] == r:
                tensors[k] = pad_columns(t, 0, response - r)
            else:
                raise ValueError(
                    f"cannot merge rollout batches: field {k!r} is {t.shape[1]} wide, neither prompt + response ({p} + {r}) nor "
                    f"the response ({r}); a prompt-side field must be named in trellis.batch.PROMPT_SIDE"
                )
        if "position_ids" in tensors and tensors["position_ids"].shape == tensors.get("attention_mask", torch.empty(0)).shape:
            tensors["position_ids"] = position_ids(tensors["attention_mask"])
        out.append(Batch(tensors, b.non_tensors, b.meta))
    return out


def _prompt_len(batch: Batch) -> int:
    return batch.tensors["input_ids"].shape[1] - batch.tensors["responses"].shape[1]


def pad_columns(t: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """``t`` ``(batch, width, ...)`` with ``left`` and ``right`` zero columns added on dimension 1."""
    if not left and not right:
        return t
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (left, right))


def _object_array(values: Sequence[Any] | np.ndarray) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == object:
        return values
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _plain(value: Any) -> Any:
    """``value`` with numpy arrays and scalars (at any depth of lists, tuples and dicts) as lists and numbers."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _as_index(key: Any, n: int) -> torch.Tensor:
    if isinstance(key, slice):
        return torch.arange(n)[key]
    index = torch.as_tensor(np.asarray(key) if not isinstance(key, torch.Tensor) else key)
    if index.dtype == torch.bool:
        if index.numel() != n:
            raise IndexError(f"boolean mask has {index.numel()} entries, the batch has {n} samples")
        return index.nonzero().flatten()
    return index.long().flatten()
