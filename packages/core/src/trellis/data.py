"""Data in verl's schema (parquet or JSONL): rows, chat rendering, prompt datasets for RL, resumable loaders.

A row of a prompt file has ``prompt`` (chat messages), ``data_source``, ``reward_model.ground_truth``
and optionally ``ability``, ``extra_info`` and ``agent_name`` (the agent loop of a multi-turn row),
so existing verl data runs unchanged. Loaders give
a deterministic order per epoch from ``(seed, epoch)`` and resume at the next batch from
``state_dict()``.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from trellis.batch import Batch, position_ids
from trellis.interfaces.backend import IMAGE_INPUTS
from trellis.interfaces.rollout import pad_id
from trellis.rng import stream_seed

logger = logging.getLogger("trellis")

PROMPT_COLUMNS = ("prompt", "data_source", "reward_model.ground_truth")
_SCHEMA_HINT = "verl's schema: prompt (chat messages), data_source, reward_model.ground_truth, optional ability and extra_info"


_TEXT_ONLY_FIX = "its config.json has no vision tower: train a vision-language model (Qwen2-VL, Qwen2.5-VL) on these rows, or drop the column"


class DataError(ValueError):
    """A data file or row is unusable; the message names the file, the row or column, and the fix."""


# -- files -----------------------------------------------------------------------------------------
def load_rows(
    path: str | os.PathLike | Sequence[str | os.PathLike], *, required: Sequence[str] | None = None, schema: str = _SCHEMA_HINT
) -> list[dict[str, Any]]:
    """Rows of a ``.parquet`` or ``.jsonl`` file (or of several files, one after another) as dicts.

    required: columns every row must have (not None); a dotted name such as
        ``reward_model.ground_truth`` looks inside a nested dict. None (default) = ``messages`` when
        the file's first row has it (chat SFT data), else ``prompt``. RL callers that want verl's full
        schema checked pass ``required=PROMPT_COLUMNS``; ``()`` checks nothing.
    schema: the format the caller reads, named in the error for a missing column (default verl's).
    """
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not paths:
        raise DataError("load_rows: no data file given; pass the path of a .parquet or .jsonl file")
    rows: list[dict[str, Any]] = []
    for p in paths:
        file_rows = _read_file(Path(p))
        if not file_rows:
            raise DataError(f"data file {str(p)!r} has no rows")
        need = required if required is not None else (("messages",) if file_rows[0].get("messages") is not None else ("prompt",))
        _check_columns(file_rows, need, Path(p), schema)
        rows.extend(file_rows)
    return rows


def _read_file(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist; give the path of a .parquet or .jsonl file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises several types for a damaged file
            raise DataError(f"data file {str(path)!r} is not a readable parquet file: {exc}") from None
    if suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{lineno} is not valid JSON ({exc.msg}); JSONL needs one JSON object per line") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{lineno} holds a {type(row).__name__}, not a JSON object; JSONL needs one object per line")
                rows.append(row)
        return rows
    raise DataError(f"data file {str(path)!r}: unknown format {suffix!r}; use .parquet or .jsonl")


def _check_columns(rows: list[dict[str, Any]], required: Sequence[str], path: Path, schema: str) -> None:
    for column in required:
        for i, row in enumerate(rows):
            if row_value(row, column) is None:
                raise DataError(f"data file {str(path)!r}: row {i} has no column {column!r} (columns: {sorted(row)}); add it to every row ({schema})")


def row_value(row: dict[str, Any], dotted: str) -> Any:
    """A row's column by dotted name (``extra_info.answer``); None when any part is missing."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def chat_messages(value: Any, where: str) -> list[dict[str, Any]]:
    """Chat messages from a row's prompt: a list of {role, content}, or a plain string (one user turn)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, (list, tuple)) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value) and value:
        return [dict(m) for m in value]
    raise DataError(f"{where} must be chat messages [{{'role': ..., 'content': ...}}, ...] or a string, got {value!r:.200}")


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, kwargs: dict[str, Any]) -> str:
    """``messages`` as text through the tokenizer's chat template (``kwargs`` go to the template)."""
    if not messages and not generation_prompt:
        return ""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; use a model folder with "
            "chat_template.jinja (trellis make-tiny-model writes one) or set tokenizer.chat_template"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)


def renders_tools(tokenizer: Any, kwargs: dict[str, Any], tools: list[dict[str, Any]]) -> bool:
    """Whether the tokenizer's chat template puts ``tools`` (OpenAI function schemas) into a prompt:
    a template that ignores them renders the same text with and without."""
    probe = [{"role": "user", "content": "?"}]
    without = {k: v for k, v in kwargs.items() if k != "tools"}
    return render_chat(tokenizer, probe, True, {**without, "tools": tools}) != render_chat(tokenizer, probe, True, without)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as written (special-token strings in it become their ids; none added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def require_pad_id(tokenizer: Any) -> int:
    pad = pad_id(tokenizer)
    if pad is None:
        raise DataError("the tokenizer has neither a pad token nor an eos token; set tokenizer.pad_token")
    return int(pad)


# -- prompts (RL) ----------------------------------------------------------------------------------
class PromptEncoder(Protocol):
    """Renders and tokenizes prompts whose rows carry images (kind ``prompt_encoder``: trellis-vision's
    ``images``, built as ``factory(model_path, tokenizer, data_section)`` for a model that takes images)."""

    def encode(self, messages: list[dict[str, Any]], row: dict[str, Any], where: str, template_kwargs: dict[str, Any]) -> tuple[list[int], Any]:
        """The prompt's token ids (the chat template given ``template_kwargs``, e.g. ``tools``), each
        image's placeholder expanded, and what :meth:`model_inputs` needs of the row later (kept with
        the item); a bad image is refused naming ``where`` (the row)."""

    def model_inputs(self, kept: Any) -> dict[str, torch.Tensor]:
        """The sample's :data:`~trellis.interfaces.backend.IMAGE_INPUTS` dict (empty: no image)."""

    def encode_turn(self, text: str, images: list[Any], where: str) -> tuple[list[int], dict[str, torch.Tensor]]:
        """An environment turn rendered as ``text`` (one image placeholder per image, in order) as token
        ids with each placeholder expanded, and its images' ``IMAGE_INPUTS`` dict (a tool's images)."""


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
                raise DataError(f"row {i} has no {prompt_key!r} column (columns: {sorted(row)}); {_SCHEMA_HINT}")
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


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, position_ids)``, each ``(batch, longest)``, padded on the left.

    position_ids: :func:`trellis.batch.position_ids` (padding gets 0).
    """
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        if s:
            ids[r, width - len(s) :] = torch.as_tensor(s, dtype=torch.long)
            mask[r, width - len(s) :] = 1
    return ids, mask, position_ids(mask)


# -- loaders ---------------------------------------------------------------------------------------
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


class PromptLoader(EpochLoader):
    """Batches of ``batch_size_prompts`` prompts from a :class:`PromptDataset`, left-padded (see
    :meth:`PromptDataset.collate`). ``batch.meta`` holds ``epoch`` and ``step_in_epoch``."""

    unit = "prompts"
    size_key = "data.train_batch_prompts"

    def __init__(self, dataset: PromptDataset, batch_size_prompts: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True) -> None:
        super().__init__(len(dataset), batch_size_prompts, seed, shuffle, drop_last)
        self.dataset = dataset


def encode_response(tokenizer: Any, target: str) -> list[int]:
    """A target answer's token ids as the model would generate them after the prompt: the text,
    then the eos token (unless the text already ends with it)."""
    eos = tokenizer.eos_token or ""
    return encode_text(tokenizer, target if eos and target.endswith(eos) else target + eos)
