"""The ``sft`` recipe's data: tokenized SFT samples with a loss mask, and resumable loaders of
padded or packed batches."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from trellis import Batch, DataError, PromptEncoder, chat_messages, encode_response, encode_text, position_ids, render_chat, require_pad_id, row_value
from trellis_algos.loaders import EpochLoader
from trellis_algos.prompts import has_images, image_field, refuse_images

logger = logging.getLogger("trellis")


class SFTDataset:
    """Tokenized SFT samples with a loss mask.

    A row is either chat ``messages`` (loss on every assistant turn) or a ``prompt`` (messages)
    plus a target in the column ``response_key`` (a dotted name such as ``extra_info.answer``;
    None = ``extra_info.answer`` when the row has it, else ``response``). The prompt is rendered
    with the chat template (generation prompt added), the target is followed by the eos token,
    and both are tokenized separately, as the model will see them when generating.

    An item's ``loss_mask`` is aligned with its ``input_ids``: 1 on response tokens, the eos /
    ``<|im_end|>`` that ends them included, 0 on prompt tokens (and on the newline a chat template
    puts after ``<|im_end|>``). The backend predicts ``input_ids[t]`` from position ``t - 1``
    wherever ``loss_mask[t] == 1``. Samples longer than ``max_length`` are cut on the right with one
    counted warning; a sample that loses every response token is dropped.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        *,
        max_length: int | None = None,
        response_key: str | None = None,
        prompt_key: str = "prompt",
        messages_key: str = "messages",
        chat_template_kwargs: dict[str, Any] | None = None,
        image_key: str = "images",
        encoder: PromptEncoder | None = None,
    ) -> None:
        if max_length is not None and max_length <= 1:
            raise DataError(f"SFT max_length={max_length} must be at least 2")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.pad_token_id = require_pad_id(tokenizer)
        self.encoder = encoder
        kwargs = dict(chat_template_kwargs or {})
        self.items: list[dict[str, Any]] = []
        truncated = dropped = 0
        for i, row in enumerate(rows):
            images, kept = has_images(row.get(image_key)), None
            if encoder is None:
                refuse_images(row, image_key, f"SFT row {i}")
            if row.get(messages_key) is not None:
                if images:
                    raise DataError(f"SFT row {i}: chat messages with images are not supported yet; give a prompt and a response column")
                ids, mask = _chat_sample(tokenizer, chat_messages(row[messages_key], f"row {i} column {messages_key!r}"), kwargs, i)
            elif row.get(prompt_key) is not None:
                target = _target(row, response_key, i)
                messages = chat_messages(row[prompt_key], f"row {i} column {prompt_key!r}")
                if encoder is None:
                    ids, mask = _prompt_response_sample(tokenizer, messages, target, kwargs)
                else:
                    prompt, kept = encoder.encode(messages, row, f"SFT row {i}", kwargs)
                    response = encode_response(tokenizer, target)
                    ids, mask = prompt + response, [0] * len(prompt) + [1] * len(response)
            else:
                raise DataError(
                    f"SFT row {i} has neither {messages_key!r} nor {prompt_key!r} (columns: {sorted(row)}); "
                    f"give chat messages, or a prompt plus a response column"
                )
            mask[0] = 0  # nothing predicts the first token
            if max_length is not None and len(ids) > max_length:
                truncated += 1
                # a cut row with images is dropped: the cut could split an image's placeholders
                ids, mask = (ids[:max_length], mask[:max_length]) if not kept else ([], [])
            if not any(mask):
                dropped += 1
                continue
            self.items.append({"input_ids": ids, "loss_mask": mask, "index": i, "kept": kept})
        if truncated:
            logger.warning(
                "SFT: %d of %d samples were longer than max_length=%s and were cut on the right (%d lost every "
                "response token and were dropped); raise max_length to keep them whole",
                truncated,
                len(rows),
                max_length,
                dropped,
            )
        if not self.items:
            raise DataError("the SFT dataset has no sample with a response token; check the rows and max_length")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def _target(row: dict[str, Any], response_key: str | None, i: int) -> str:
    if response_key is None:
        response_key = "extra_info.answer" if row_value(row, "extra_info.answer") is not None else "response"
    value = row_value(row, response_key)
    if value is None:
        raise DataError(
            f"SFT row {i} has no target column {response_key!r} (columns: {sorted(row)}); "
            "set data.response_key to the column holding the answer (e.g. extra_info.answer)"
        )
    return str(value)


def _prompt_response_sample(tokenizer: Any, messages: list[dict[str, Any]], target: str, kwargs: dict[str, Any]) -> tuple[list[int], list[int]]:
    prompt = encode_text(tokenizer, render_chat(tokenizer, messages, True, kwargs))
    response = encode_response(tokenizer, target)
    return prompt + response, [0] * len(prompt) + [1] * len(response)


def _chat_sample(tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any], row: int) -> tuple[list[int], list[int]]:
    """Tokens of a conversation, one segment per message; the loss covers assistant content up to
    and including the first eos in it."""
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"SFT row {row}: the messages have no assistant turn, so nothing to learn; add one or drop the row")
    ids: list[int] = []
    mask: list[int] = []
    eos_id = tokenizer.eos_token_id
    prev = ""

    def extend(text: str, before: str, learn: bool) -> None:
        if not text.startswith(before):
            raise DataError(
                f"SFT row {row}: the chat template does not render turn by turn as prefixes (it rewrites earlier turns), "
                "so assistant turns cannot be located; use prompt + response rows instead"
            )
        tokens = encode_text(tokenizer, text[len(before) :])
        if learn:
            cut = tokens.index(eos_id) + 1 if eos_id in tokens else len(tokens)
            mask.extend([1] * cut + [0] * (len(tokens) - cut))
        else:
            mask.extend([0] * len(tokens))
        ids.extend(tokens)

    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            head = render_chat(tokenizer, messages[:i], True, kwargs)
            extend(head, prev, learn=False)
            full = render_chat(tokenizer, messages[: i + 1], False, kwargs)
            extend(full, head, learn=True)
        else:
            full = render_chat(tokenizer, messages[: i + 1], False, kwargs)
            extend(full, prev, learn=False)
        prev = full
    return ids, mask


def _right_pad(items: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(it["input_ids"]) for it in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(items), width), dtype=torch.long)
    loss = torch.zeros((len(items), width), dtype=torch.long)
    for r, it in enumerate(items):
        n = len(it["input_ids"])
        ids[r, :n] = torch.as_tensor(it["input_ids"])
        attn[r, :n] = 1
        loss[r, :n] = torch.as_tensor(it["loss_mask"])
    return {"input_ids": ids, "attention_mask": attn, "position_ids": position_ids(attn), "loss_mask": loss}


def _pack(items: list[dict[str, Any]], pad_id: int, row_length: int) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """First-fit packing (in order) of whole samples into rows of at most ``row_length`` tokens."""
    rows: list[list[dict[str, Any]]] = []
    used: list[int] = []
    for it in items:
        n = len(it["input_ids"])
        if n > row_length:
            raise DataError(
                f"SFT sample {it['index']} has {n} tokens, more than the packing length {row_length}; "
                "give SFTDataset a max_length no larger than the packing length"
            )
        for r, u in enumerate(used):
            if u + n <= row_length:
                rows[r].append(it)
                used[r] += n
                break
        else:
            rows.append([it])
            used.append(n)
    width = max(used)
    shape = (len(rows), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    attn, pos, loss, seg = (torch.zeros(shape, dtype=torch.long) for _ in range(4))
    for r, row in enumerate(rows):
        start = 0
        for k, it in enumerate(row, 1):
            n = len(it["input_ids"])
            ids[r, start : start + n] = torch.as_tensor(it["input_ids"])
            attn[r, start : start + n] = 1
            pos[r, start : start + n] = torch.arange(n)
            loss[r, start : start + n] = torch.as_tensor(it["loss_mask"])
            seg[r, start : start + n] = k
            start += n
    tensors = {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "loss_mask": loss, "segment_ids": seg}
    return tensors, [[it["index"] for it in row] for row in rows]


class SFTLoader(EpochLoader):
    """Batches of ``batch_size_samples`` SFT samples, deterministic by ``(seed, epoch)``, resumable.

    Padding mode (``pack=False``): one sample per row, right-padded to the batch's longest;
    tensors ``input_ids``, ``attention_mask``, ``position_ids``, ``loss_mask`` ``(batch, longest)``;
    non-tensor ``index`` (row numbers of the source data).

    Packing mode (``pack=True``): the same samples per batch, laid end to end into as few rows of
    at most ``max_length`` tokens (default: the dataset's ``max_length``) as first-fit allows;
    ``position_ids`` restart at 0 for each sample and ``segment_ids`` numbers the samples of a row
    1, 2, ... (0 = padding); non-tensor ``index`` is the list of source rows in each packed row.
    Honest caveat: with eager or SDPA attention the tokens of a packed row still attend to the
    earlier samples of that row (the loss mask keeps their *labels* apart, not their context).
    Only a backend that builds varlen / block-diagonal attention from ``position_ids`` or
    ``segment_ids`` (e.g. transformers' flash_attention_2 given position_ids and no attention mask)
    makes packing equivalent to padding.

    ``batch.meta``: ``epoch``, ``step_in_epoch``, ``num_samples``, ``num_loss_tokens``, ``packed``.
    """

    unit = "samples"
    size_key = "data.batch_samples"

    def __init__(
        self,
        dataset: SFTDataset,
        batch_size_samples: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        *,
        pack: bool = False,
        max_length: int | None = None,
    ) -> None:
        super().__init__(len(dataset), batch_size_samples, seed, shuffle, drop_last)
        self.dataset = dataset
        self.pack = pack
        self.max_length = max_length if max_length is not None else dataset.max_length
        if pack and self.max_length is None:
            raise DataError("SFT packing needs a row length: set max_length (on the loader or the SFTDataset)")
        if pack and dataset.encoder is not None:
            raise DataError("SFT packing does not take samples with images (a packed row would need their image positions); set data.pack=false")

    def collate(self, indices: Sequence[int]) -> Batch:
        items = [self.dataset.items[i] for i in indices]
        if self.pack:
            tensors, index = _pack(items, self.dataset.pad_token_id, self.max_length)
        else:
            tensors, index = _right_pad(items, self.dataset.pad_token_id), [it["index"] for it in items]
        meta = {"num_samples": len(items), "num_loss_tokens": int(tensors["loss_mask"].sum()), "packed": self.pack}
        return Batch(tensors, {"index": index, **image_field(self.dataset.encoder, items)}, meta)


def sft_batches(
    dataset: SFTDataset,
    batch_size_samples: int,
    *,
    seed: int = 0,
    shuffle: bool = False,
    drop_last: bool = False,
    pack: bool = False,
    max_length: int | None = None,
) -> list[Batch]:
    """One epoch of SFT batches (by default in order and keeping the last partial batch), e.g. for
    a held-out loss over every sample."""
    loader = SFTLoader(dataset, batch_size_samples, seed, shuffle, drop_last, pack=pack, max_length=max_length)
    return [loader.next_batch() for _ in range(len(loader))]
