"""Prompts in verl's schema for the recipes that generate (``rl``, ``spin``): a row has ``prompt`` (chat
messages), ``data_source``, ``reward_model.ground_truth`` and optionally ``ability``, ``extra_info`` and
``agent_name`` (the agent loop of a multi-turn row), so existing verl data runs unchanged; tokenized
with the chat template (a vision-language model's images through its prompt encoder), left-padded,
served by a resumable loader."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from trellis import (
    IMAGE_INPUTS,
    VERL_SCHEMA,
    Batch,
    ConfigError,
    DataError,
    PromptEncoder,
    RegistryError,
    chat_messages,
    encode_text,
    load_rows,
    render_chat,
    require_pad_id,
)
from trellis.kit.recipe import left_pad, model_config
from trellis_algos.loaders import EpochLoader

logger = logging.getLogger("trellis")

PROMPT_COLUMNS = ("prompt", "data_source", "reward_model.ground_truth")
_TEXT_ONLY_FIX = "its config.json has no vision tower: train a vision-language model (Qwen2-VL, Qwen2.5-VL) on these rows, or drop the column"


class PromptDataset:
    """Prompts tokenized with the tokenizer's chat template (generation prompt added).

    Prompts longer than ``max_prompt_length`` tokens are dropped with one warning that counts them.
    ``index`` of an item is the row's position in ``rows`` (unique; ``extra_info.index`` stays in
    ``extra_info``).
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        max_prompt_length: int,
        *,
        prompt_key: str = "prompt",
        chat_template_kwargs: dict[str, Any] | None = None,
        image_key: str = "images",
        encoder: PromptEncoder | None = None,
    ) -> None:
        if max_prompt_length <= 0:
            raise DataError(f"max_prompt_length={max_prompt_length} must be positive")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.pad_token_id = require_pad_id(tokenizer)
        self.encoder = encoder
        kwargs = dict(chat_template_kwargs or {})
        self.items: list[dict[str, Any]] = []
        too_long: list[int] = []
        for i, row in enumerate(rows):
            if prompt_key not in row:
                raise DataError(f"row {i} has no {prompt_key!r} column (columns: {sorted(row)}); {VERL_SCHEMA}")
            messages = chat_messages(row[prompt_key], f"row {i} column {prompt_key!r}")
            if encoder is not None:
                ids, kept = encoder.encode(messages, row, f"row {i}", kwargs)
            else:
                refuse_images(row, image_key, f"row {i}")
                ids, kept = encode_text(tokenizer, render_chat(tokenizer, messages, True, kwargs)), None
            if len(ids) > max_prompt_length:
                too_long.append(len(ids))
                continue
            reward_model = row.get("reward_model") or {}
            known = (prompt_key, image_key, "data_source", "extra_info", "ability", "agent_name")
            self.items.append(
                {
                    "input_ids": ids,
                    "raw_prompt": messages,
                    "data_source": row.get("data_source"),
                    "ground_truth": reward_model.get("ground_truth") if isinstance(reward_model, dict) else None,
                    "extra_info": row.get("extra_info") or {},
                    "ability": row.get("ability"),
                    "agent_name": row.get("agent_name"),
                    "index": i,
                    "columns": {k: v for k, v in row.items() if k not in known},  # the rest as read (reward_model among them)
                    "kept": kept,
                }
            )
        if too_long and not self.items:
            raise DataError(
                f"all {len(too_long)} prompts are longer than max_prompt_length={max_prompt_length} tokens "
                f"(shortest {min(too_long)}); raise data.max_prompt_length"
            )
        if too_long:
            logger.warning(
                "filtered %d of %d prompts longer than max_prompt_length=%d tokens (longest %d); raise max_prompt_length to keep them",
                len(too_long),
                len(rows),
                max_prompt_length,
                max(too_long),
            )
        if not self.items:
            raise DataError("the prompt dataset is empty; give a data file with rows")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]

    def collate(self, indices: Sequence[int]) -> Batch:
        """A left-padded Batch of items ``indices``: ``input_ids``, ``attention_mask``, ``position_ids``
        ``(batch, longest_prompt)`` plus ``data_source``, ``ground_truth``, ``extra_info``,
        ``raw_prompt``, ``ability``, ``agent_name`` (None where the row has none), ``index``,
        ``columns`` (a dict of the row's other columns, as an agent loop that takes the row's fields
        gets them: verl hands its loops every column) and ``uid``: a fresh id per prompt row, which
        every sample generated from it keeps (estimators group samples by it, never by position)."""
        items = [self.items[i] for i in indices]
        input_ids, attention_mask, position_ids = left_pad([it["input_ids"] for it in items], self.pad_token_id)
        fields = ("data_source", "ground_truth", "extra_info", "raw_prompt", "ability", "agent_name", "index", "columns")
        return Batch(
            {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
            {**{k: [it[k] for it in items] for k in fields}, **image_field(self.encoder, items), "uid": [uuid.uuid4().hex for _ in items]},
        )

    def as_batch(self) -> Batch:
        """Every prompt in one left-padded Batch, in dataset order (for validation)."""
        return self.collate(range(len(self)))


def load_prompt_data(
    data: Any, tokenizer: Any, seed: int, template_kwargs: dict[str, Any] | None = None, encoder: PromptEncoder | None = None
) -> tuple[PromptLoader, PromptDataset | None]:
    """The training prompt loader and the held-out prompts (None without ``val_path``) of a
    ``PromptData`` config section; ``template_kwargs`` go to the chat template (e.g. ``tools``);
    ``encoder``: the prompt encoder of a model that takes images (None: text)."""
    train_rows, val_rows = load_prompt_rows(data)

    def dataset(rows: list[dict[str, Any]]) -> PromptDataset:
        return PromptDataset(rows, tokenizer, data.max_prompt_length, chat_template_kwargs=template_kwargs, image_key=data.image_key, encoder=encoder)

    train = PromptLoader(dataset(train_rows), data.train_batch_prompts, seed=seed, shuffle=data.shuffle)
    return train, dataset(val_rows) if val_rows else None


def load_prompt_rows(data: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The raw rows of a ``PromptData`` section's training and held-out files (for checks made
    before anything is built)."""
    val_rows = load_rows(data.val_path, required=PROMPT_COLUMNS)[: data.val_max_prompts or None] if data.val_path else []
    return load_rows(data.train_path, required=PROMPT_COLUMNS), val_rows


class PromptLoader(EpochLoader):
    """Batches of ``batch_size_prompts`` prompts from a :class:`PromptDataset`, left-padded (see
    :meth:`PromptDataset.collate`). ``batch.meta`` holds ``epoch`` and ``step_in_epoch``."""

    unit = "prompts"
    size_key = "data.train_batch_prompts"

    def __init__(self, dataset: PromptDataset, batch_size_prompts: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True) -> None:
        super().__init__(len(dataset), batch_size_prompts, seed, shuffle, drop_last)
        self.dataset = dataset


def has_images(value: Any) -> bool:
    """Whether a row's image column holds any image (None, an empty list or array: none)."""
    return value is not None and len(value) > 0


def refuse_images(row: dict[str, Any], image_key: str, where: str) -> None:
    """Refuse a row with images for a model that takes text only (no prompt encoder)."""
    if has_images(row.get(image_key)):
        raise DataError(f"{where} holds images in column {image_key!r}, but the model takes text only; {_TEXT_ONLY_FIX}")


def image_field(encoder: PromptEncoder | None, items: list[dict[str, Any]]) -> dict[str, list]:
    """The batch field of the items' images (:data:`IMAGE_INPUTS`, from what their encoder kept); none without an encoder."""
    return {IMAGE_INPUTS: [encoder.model_inputs(it["kept"]) for it in items]} if encoder is not None else {}


def prompt_images(model_path: str, data: Any, registry, tokenizer) -> PromptEncoder | None:
    """The prompt encoder (kind ``prompt_encoder``, ``images``: trellis-vision) of a ``model_path`` that
    takes images (a vision tower in its config.json), built for the ``data`` section; None for a text model."""
    if "vision_config" not in model_config(model_path):
        return None
    try:
        factory = registry.get("prompt_encoder", "images").obj
    except RegistryError as exc:
        raise ConfigError(f"config key 'model.path': {model_path!r} is a vision-language model; reading its image prompts: {exc}") from None
    return factory(model_path, tokenizer, data)
