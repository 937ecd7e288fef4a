"""Data files and chat text: rows of parquet or JSONL files (verl's schema by default), chat messages
rendered and tokenized as the model's chat template does, left padding, the protocol of a
vision-language model's prompt encoder. The recipes' datasets and loaders are trellis-algos'."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from trellis.batch import position_ids
from trellis.interfaces.rollout import pad_id

# verl's schema of a prompt row, named in the errors of files read in it (load_rows' default)
VERL_SCHEMA = "verl's schema: prompt (chat messages), data_source, reward_model.ground_truth, optional ability and extra_info"


class DataError(ValueError):
    """A data file or row is unusable; the message names the file, the row or column, and the fix."""


# -- files -----------------------------------------------------------------------------------------
def load_rows(
    path: str | os.PathLike | Sequence[str | os.PathLike], *, required: Sequence[str] | None = None, schema: str = VERL_SCHEMA
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


def encode_response(tokenizer: Any, target: str) -> list[int]:
    """A target answer's token ids as the model would generate them after the prompt: the text,
    then the eos token (unless the text already ends with it)."""
    eos = tokenizer.eos_token or ""
    return encode_text(tokenizer, target if eos and target.endswith(eos) else target + eos)
