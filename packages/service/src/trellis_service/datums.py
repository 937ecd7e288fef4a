"""Datums to a trellis ``Batch``, with Tinker's next-token alignment: target ``i`` is the token the
model predicts after input position ``i``, so ``logprobs[i] = log p(target_tokens[i] | model_input[: i + 1])``.

A datum of ``N`` input tokens becomes one row laid out as the backends' response forwards read
it: the first input token is the prompt, the response is ``model_input[1:]`` plus one more token
(the last target, which no position reads), and the batch field ``top_ids`` ``(rows, N, 1)`` holds
the targets, so the backend's ``top_ids_log_probs`` at response position ``i`` (which predicts from
``model_input[: i + 1]``) is exactly the target's log-prob. Rows of different lengths are
right-padded; ``response_mask`` marks the real positions.
"""

from __future__ import annotations

import numpy as np
import torch

from trellis import Batch, position_ids
from trellis_service.errors import UserError
from trellis_service.losses import LossSpec
from trellis_service.wire import WireDatum

TARGETS = "top_ids"  # the batch field the backends' top_ids_log_probs reads
FLOAT_INPUTS = ("weights", "logprobs", "advantages")


def check_datum(index: int, datum: WireDatum, spec: LossSpec, loss_fn: str, vocab: int) -> None:
    """Refuse a datum whose inputs do not fit its tokens or its loss, naming the field."""
    n = len(datum.tokens)
    if n == 0:
        raise UserError(f"data[{index}].model_input is empty; a Datum needs at least one input token")
    missing = [k for k in spec.required if k not in datum.inputs]
    if missing:
        raise UserError(f"data[{index}].loss_fn_inputs lacks {missing}, which loss_fn {loss_fn!r} needs")
    extra = sorted(set(datum.inputs) - set(spec.required) - set(spec.optional))
    if extra:
        raise UserError(f"data[{index}].loss_fn_inputs has {extra}, which loss_fn {loss_fn!r} does not read; remove them")
    for name, value in datum.inputs.items():
        if value.shape != (n,):
            raise UserError(
                f"data[{index}].loss_fn_inputs[{name!r}] has shape {list(value.shape)}, but model_input has {n} tokens: "
                f"it must be [{n}] (entry i belongs to the target after input position i)"
            )
    targets = datum.inputs["target_tokens"]
    bad = [int(t) for t in list(targets) + datum.tokens if not 0 <= t < vocab]
    if bad:
        raise UserError(f"data[{index}]: token id {bad[0]} is outside the model's vocabulary of {vocab}")


def datum_batch(data: list[WireDatum]) -> Batch:
    """The rows of ``data`` (see the module's docstring), with each float input padded beside them."""
    width = max(len(d.tokens) for d in data)
    rows = len(data)
    prompts = torch.tensor([[d.tokens[0]] for d in data], dtype=torch.long)
    responses = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    targets = torch.zeros(rows, width, 1, dtype=torch.long)
    floats = {name: torch.zeros(rows, width) for name in FLOAT_INPUTS if any(name in d.inputs for d in data)}
    for i, d in enumerate(data):
        n = len(d.tokens)
        target = torch.from_numpy(np.asarray(d.inputs["target_tokens"], dtype=np.int64))
        responses[i, :n] = torch.cat([torch.tensor(d.tokens[1:], dtype=torch.long), target[-1:]])
        mask[i, :n] = 1
        targets[i, :n, 0] = target
        for name, padded in floats.items():
            if name in d.inputs:
                padded[i, :n] = torch.from_numpy(np.asarray(d.inputs[name], dtype=np.float32))
            elif name == "weights":
                padded[i, :n] = 1.0  # cross_entropy without weights trains on every target
    attention = torch.cat([torch.ones(rows, 1, dtype=torch.long), mask], dim=1)
    fields = {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": position_ids(attention),
        "responses": responses,
        "response_mask": mask,
        TARGETS: targets,
        **floats,
    }
    return Batch(fields, meta={"temperature": 1.0})


def micro_batches(batch: Batch, token_budget: int) -> list[Batch]:
    """``batch`` cut into consecutive micro-batches of at most ``token_budget`` padded tokens (one row at least)."""
    width = batch["input_ids"].shape[1]
    size = max(1, token_budget // max(width, 1))
    return batch.split(size)
