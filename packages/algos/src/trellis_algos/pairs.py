"""Preference pairs for reward-model training (the ``rm`` recipe): rows in verl's / TRL's pair
format, tokenized as a rollout would hold them, and resumable batches of pairs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from trellis import Batch, DataError, chat_messages, encode_response, encode_text, position_ids, render_chat, require_pad_id
from trellis_algos.loaders import EpochLoader

logger = logging.getLogger("trellis")

SIDES = ("chosen", "rejected")
# what a pair row holds, named when a file lacks a column
PAIR_SCHEMA = (
    "the rm recipe's preference pairs: chosen and rejected, each chat messages or an answer string after a shared prompt column; optional margin"
)


def conversation(row: dict[str, Any], side: str, i: int) -> list[dict[str, Any]]:
    """The messages of one side of pair row ``i``: ``chosen`` / ``rejected`` as chat messages
    (a whole conversation, or the answer alone after a shared ``prompt``) or as a plain answer
    string after ``prompt``; the last message is the assistant's answer."""
    value, prompt = row.get(side), row.get("prompt")
    if value is None:
        raise DataError(f"pair row {i} has no {side!r} column (columns: {sorted(row)}); give chosen and rejected answers")
    head = chat_messages(prompt, f"pair row {i} column 'prompt'") if prompt is not None else []
    if isinstance(value, str):
        if not head:
            raise DataError(f"pair row {i}: {side!r} is a plain string, which needs a 'prompt' column to answer; add it, or give chat messages")
        messages = [*head, {"role": "assistant", "content": value}]
    else:
        messages = [*head, *chat_messages(value, f"pair row {i} column {side!r}")]
    if messages[-1]["role"] != "assistant":
        raise DataError(f"pair row {i}: the last message of {side!r} is a {messages[-1]['role']!r} turn; it must be the assistant's answer")
    return messages


def encode_conversation(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids as a rollout holds a sample: the earlier turns through the chat template with
    the generation prompt, then the answer and the eos token, as the policy generates it (so a
    reward model scores its own training layout at the rollout's last token)."""
    prompt = encode_text(tokenizer, render_chat(tokenizer, messages[:-1], True, {}))
    return prompt + encode_response(tokenizer, str(messages[-1]["content"]))


class PairDataset:
    """Tokenized preference pairs: each item's ``chosen`` and ``rejected`` token ids and its
    ``margin`` (the row's ``margin`` column, else 0). A pair with a side longer than
    ``max_length`` tokens is dropped (cutting it would move the token its score is read at),
    with one counted warning."""

    def __init__(self, rows: Sequence[dict[str, Any]], tokenizer: Any, max_length: int) -> None:
        self.pad_token_id = require_pad_id(tokenizer)
        self.items: list[dict[str, Any]] = []
        dropped = 0
        for i, row in enumerate(rows):
            chosen, rejected = (encode_conversation(tokenizer, conversation(row, side, i)) for side in SIDES)
            if max(len(chosen), len(rejected)) > max_length:
                dropped += 1
                continue
            self.items.append({"chosen": chosen, "rejected": rejected, "margin": float(row.get("margin") or 0.0), "index": i})
        if dropped:
            logger.warning("pairs: %d of %d pairs have a side longer than max_length=%d tokens and were dropped", dropped, len(rows), max_length)
        if not self.items:
            raise DataError(f"no pair fits max_length={max_length} tokens (of {len(rows)} rows); raise data.max_length")

    def __len__(self) -> int:
        return len(self.items)

    def collate(self, indices: Sequence[int]) -> Batch:
        """Pairs ``indices`` as a batch of ``trellis.SCORED_PAIR_FIELDS``: ``chosen_input_ids`` /
        ``_attention_mask`` / ``_position_ids`` and the same for ``rejected_``, each ``(pairs,
        longest)`` right-padded; ``margin`` ``(pairs,)``; non-tensor ``index`` (source rows)."""
        items = [self.items[i] for i in indices]
        fields: dict[str, torch.Tensor] = {}
        for side in SIDES:
            seqs = [it[side] for it in items]
            ids = torch.full((len(seqs), max(map(len, seqs))), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, s in enumerate(seqs):
                ids[r, : len(s)] = torch.as_tensor(s)
                mask[r, : len(s)] = 1
            fields |= {f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_position_ids": position_ids(mask)}
        fields["margin"] = torch.tensor([it["margin"] for it in items], dtype=torch.float32)
        return Batch(fields, {"index": [it["index"] for it in items]})

    def as_batch(self) -> Batch:
        return self.collate(range(len(self)))


class PairLoader(EpochLoader):
    """Batches of ``batch_pairs`` pairs, deterministic by ``(seed, epoch)``, resumable;
    ``batch.meta`` holds ``epoch`` and ``step_in_epoch``."""

    unit = "pairs"
    size_key = "data.batch_pairs"

    def __init__(self, dataset: PairDataset, batch_pairs: int, seed: int = 0, shuffle: bool = True) -> None:
        super().__init__(len(dataset), batch_pairs, seed, shuffle, drop_last=True)
        self.dataset = dataset
