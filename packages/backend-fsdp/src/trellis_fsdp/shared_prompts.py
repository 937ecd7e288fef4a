"""The shared-prompt layout of a micro-batch: each prompt's tokens run once for all of its samples there (GRPO's n samples of a prompt)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trellis import Batch
from trellis.kit.backend import RESPONSE_OUTPUTS, expert_counts, response_outputs, vision_tower


@dataclass
class SharedRows:
    """A micro-batch as rows of one prompt followed by responses of its samples, each response
    attending to the prompt and to itself only (positions as in the padded layout, so every
    response sees what it saw there). Every prompt ends at column ``prompt_end`` (left padding).

    input_ids, position_ids: ``(rows, width)``.
    attend: ``(rows, 1, width, width)`` bool, True where a query column attends to a key column.
    row, column: ``(tokens,)``: where the logits that predict each attended response token are, in
        row-major order over ``where``; ``column`` counts from ``prompt_end - 1``, the first column
        whose logits are kept.
    where: ``(batch, response_len)`` True at each sample's attended response tokens.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attend: torch.Tensor
    prompt_end: int
    row: torch.Tensor
    column: torch.Tensor
    where: torch.Tensor

    @property
    def keep(self) -> int:
        """``logits_to_keep``: every column from the prompts' last token on."""
        return self.input_ids.shape[1] - self.prompt_end + 1


def applies(model: torch.nn.Module, micro: Batch, outputs: tuple[str, ...]) -> bool:
    """Whether the layout can compute ``outputs`` for ``micro`` on ``model``: response outputs of a
    dense text model whose every layer attends to the whole sequence through sdpa (which takes the
    layout's mask as it is), with no routes to replay."""
    config = model.config
    layers = getattr(config, "layer_types", None) or ("full_attention",)
    windowed = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    return (
        bool(outputs)
        and set(outputs) <= set(RESPONSE_OUTPUTS)
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and set(layers) == {"full_attention"}
        and not windowed
        and expert_counts(config) is None
        and vision_tower(model) is None
        and "responses" in micro
    )


def shared_rows(micro: Batch, hidden_size: int) -> SharedRows | None:
    """``micro``'s shared-prompt layout, or None where the padded layout does no more work (no two
    samples share a prompt, or too few tokens are saved to pay for the longer rows' attention) or
    cannot be matched (an empty prompt, one not left-padded, a response whose attended tokens are
    not one run from its start). Samples share a prompt when its attended tokens and positions are equal; a
    row takes up to ``m`` of them, ``m`` chosen by :func:`_cost`."""
    ids, positions, mask = micro["input_ids"].cpu(), micro["position_ids"].cpu(), micro["attention_mask"].cpu().bool()
    if positions.shape != ids.shape:  # multimodal positions
        return None
    n = micro["responses"].shape[1]
    p = ids.shape[1] - n
    prompt_len, response_len = mask[:, :p].sum(-1), mask[:, p:].sum(-1)
    left_padded = torch.arange(p) >= p - prompt_len[:, None]
    right_padded = torch.arange(n) < response_len[:, None]
    if not prompt_len.all() or not torch.equal(mask, torch.cat([left_padded, right_padded], 1)):
        return None
    groups: dict[bytes, list[int]] = {}
    for i in range(len(ids)):
        prompt = slice(p - int(prompt_len[i]), p)
        groups.setdefault(torch.cat([ids[i, prompt], positions[i, prompt]]).numpy().tobytes(), []).append(i)
    largest = max(map(len, groups.values()))
    if largest < 2:
        return None
    prompt_end = int(prompt_len.max())

    def rows_of(m: int) -> list[list[int]]:
        return [members[k : k + m] for members in groups.values() for k in range(0, len(members), m)]

    def cost(rows: list[list[int]]) -> float:
        return _cost(len(rows), prompt_end + max(int(response_len[r].sum()) for r in rows), hidden_size)

    rows = min((rows_of(m) for m in range(2, largest + 1)), key=cost)
    if cost(rows) >= _cost(len(ids), ids.shape[1], hidden_size):
        return None
    return _layout(rows, ids, positions, prompt_len, response_len, prompt_end, mask[:, p:])


def _cost(rows: int, width: int, hidden_size: int) -> float:
    """A forward's work on ``rows`` rows of ``width`` tokens, per layer and in units of ``4 *
    hidden_size`` multiply-adds a token: about ``24 h^2`` in the linear layers (attention
    projections and an MLP of ``4h``) and ``4 h width`` in attention, which is quadratic in the width
    (sdpa computes the masked-out scores too)."""
    return rows * width * (6 * hidden_size + width)


def _layout(
    rows: list[list[int]],
    ids: torch.Tensor,
    positions: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
    prompt_end: int,
    where: torch.Tensor,
) -> SharedRows:
    batch, n = where.shape
    p = ids.shape[1] - n
    width = prompt_end + max(int(response_len[r].sum()) for r in rows)
    input_ids, position_ids = ids.new_zeros(len(rows), width), positions.new_zeros(len(rows), width)
    segment = torch.full((len(rows), width), -1)  # -1 padding, 0 the prompt, k the row's k-th response
    row_of, start = torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long)
    for r, members in enumerate(rows):
        head = int(prompt_len[members[0]])
        at, src = slice(prompt_end - head, prompt_end), slice(p - head, p)
        input_ids[r, at], position_ids[r, at], segment[r, at] = ids[members[0], src], positions[members[0], src], 0
        column = prompt_end
        for k, i in enumerate(members, 1):
            length = int(response_len[i])
            at, src = slice(column, column + length), slice(p, p + length)
            input_ids[r, at], position_ids[r, at], segment[r, at] = ids[i, src], positions[i, src], k
            row_of[i], start[i] = r, column
            column += length
    query, key = segment[:, :, None], segment[:, None, :]
    attend = torch.ones(width, width, dtype=torch.bool).tril() & (query >= 0) & ((key == 0) | (key == query))
    attend |= torch.eye(width, dtype=torch.bool)  # padding attends to itself: a query with no key would make NaN
    # token t of a response is predicted at the column before it: the prompt's last for t = 0
    t = torch.arange(n).expand(batch, n)
    column = torch.where(t == 0, 0, start[:, None] + t - prompt_end)[where]
    return SharedRows(input_ids, position_ids, attend[:, None], prompt_end, row_of[:, None].expand(batch, n)[where], column, where)


def shared_outputs(model: torch.nn.Module, micro: Batch, outputs: tuple[str, ...], chunk_size: int | None) -> dict[str, torch.Tensor] | None:
    """The response ``outputs`` ``(batch, response_len)`` of ``micro`` computed in the shared-prompt
    layout (equal to the padded layout's at every attended token, 0 elsewhere), or None where the
    layout does not apply (:func:`applies`) or would not save work (:func:`shared_rows`)."""
    if not applies(model, micro, outputs):
        return None
    rows = shared_rows(micro, model.config.hidden_size)
    if rows is None:
        return None
    device = next(model.parameters()).device
    logits = model(
        input_ids=rows.input_ids.to(device),
        position_ids=rows.position_ids.to(device),
        attention_mask=rows.attend.to(device),
        logits_to_keep=rows.keep,
    ).logits
    return response_outputs(logits[rows.row.to(device), rows.column.to(device)], micro, rows.where, outputs, chunk_size)
