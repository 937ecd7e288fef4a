"""The shared-prompt layout (each prompt once per micro-batch, its samples' responses after it)
against the padded one: the same outputs and gradients on groups of samples with mixed prompt
widths and response lengths, the same update through the FSDP worker, and when it is not used."""

from __future__ import annotations

import copy

import pytest
import torch
from test_fsdp_worker import OBJECTIVES, actor_options, make_worker
from test_shortcuts import assert_same_weights
from transformers import AutoModelForCausalLM

from trellis import Batch
from trellis.kit.backend import forward_outputs
from trellis.plugins import load_plugins
from trellis_fsdp.shared_prompts import _cost, applies, shared_outputs, shared_rows

# three prompts of 2, 5 and 3 tokens (padded to 5), with 3, 2 and 4 samples; responses of 1 to 6 of 6 tokens
PROMPT_LENS, SAMPLES_PER_PROMPT, RESPONSE = (2, 5, 3), (3, 2, 4), 6


def grouped_batch(vocab: int, seed: int = 0, full: bool = False) -> Batch:
    """Samples of a few prompts, left-padded prompts of mixed widths, right-padded responses of
    mixed lengths (one of them the full width; ``full``: all), random advantages and old log-probs."""
    g = torch.Generator().manual_seed(seed)
    width = max(PROMPT_LENS)
    rows = []
    for length, n in zip(PROMPT_LENS, SAMPLES_PER_PROMPT):
        prompt = torch.randint(3, vocab, (length,), generator=g)
        rows += [torch.cat([torch.zeros(width - length, dtype=torch.long), prompt])] * n
    prompts = torch.stack(rows)
    prompt_mask = (prompts != 0).long()
    samples = len(prompts)
    resp_len = torch.randint(1, RESPONSE + 1, (samples,), generator=g)
    resp_len[0] = RESPONSE
    if full:
        resp_len[:] = RESPONSE
    response_mask = (torch.arange(RESPONSE) < resp_len[:, None]).long()
    responses = torch.randint(3, vocab, (samples, RESPONSE), generator=g) * response_mask
    mask = torch.cat([prompt_mask, response_mask], 1)
    return Batch({
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask,
        "advantages": torch.randn(samples, 1, generator=g).expand(samples, RESPONSE) * response_mask,
        "old_log_probs": -torch.rand(samples, RESPONSE, generator=g) * response_mask,
    })  # fmt: skip


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


OUTPUTS = ("log_probs", "entropy", "sum_sq_probs")


def test_outputs_and_gradients_equal_the_padded_layout(model):
    batch = grouped_batch(model.config.vocab_size)
    mask = batch["response_mask"].bool()
    rows = shared_rows(batch, model.config.hidden_size)
    assert rows is not None and len(rows.input_ids) < len(batch)  # the layout is used: fewer rows than samples
    results = []
    for forward in (lambda: forward_outputs(model, batch, OUTPUTS, "lm"), lambda: shared_outputs(model, batch, OUTPUTS, None)):
        out = forward()
        grads = torch.autograd.grad((out["log_probs"] * batch["advantages"]).sum() + (out["entropy"] * mask).sum(), list(model.parameters()))
        results.append((out, grads))
    (padded, padded_grads), (shared, shared_grads) = results
    for key in OUTPUTS:
        torch.testing.assert_close(shared[key][mask], padded[key][mask], atol=2e-6, rtol=1e-6)
        assert (shared[key][~mask] == 0).all()
    for a, b in zip(shared_grads, padded_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_each_response_sees_only_its_prompt_and_itself(model):
    """Changing one sample's response changes no other sample's log-probs (in the padded layout
    samples never see each other: the shared rows must not leak either)."""
    batch = grouped_batch(model.config.vocab_size)
    other = batch.select(*batch.keys())
    other["responses"] = batch["responses"].clone()
    other["responses"][1, :2] = (batch["responses"][1, :2] + 1) % model.config.vocab_size
    other["input_ids"] = torch.cat([batch["input_ids"][:, :-RESPONSE], other["responses"]], 1)
    with torch.no_grad():
        a, b = (shared_outputs(model, x, ("log_probs",), None)["log_probs"] for x in (batch, other))
    keep = torch.ones(len(batch), dtype=torch.bool)
    keep[1] = False
    torch.testing.assert_close(a[keep], b[keep], atol=0, rtol=0)
    assert not torch.equal(a[1], b[1])


def test_rows_take_a_prompt_then_its_responses_at_their_positions(model):
    """The hand-laid layout of two samples of a 2-token prompt (responses of 3 and 1 tokens) and
    one of a 3-token prompt: rows aligned so every prompt ends at column 3."""
    ids = torch.tensor([[0, 7, 8, 20, 21, 22], [0, 7, 8, 30, 0, 0], [4, 5, 6, 40, 41, 0]])
    mask = (torch.arange(6) < 6).long().expand(3, 6).clone()
    mask[:2, 0] = 0
    mask[1, 4:] = 0
    mask[2, 5] = 0
    batch = Batch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "responses": ids[:, 3:]})
    rows = shared_rows(batch, hidden_size=64)
    assert rows.input_ids.tolist() == [[0, 7, 8, 20, 21, 22, 30], [4, 5, 6, 40, 41, 0, 0]]
    assert rows.position_ids.tolist() == [[0, 0, 1, 2, 3, 4, 2], [0, 1, 2, 3, 4, 0, 0]]
    assert rows.prompt_end == 3 and rows.keep == 5
    # sample 0's tokens are predicted at columns 2 (the prompt's last), 3, 4; sample 1's at 2; sample 2's at 2, 3
    assert rows.row.tolist() == [0, 0, 0, 0, 1, 1] and (rows.column + rows.prompt_end - 1).tolist() == [2, 3, 4, 2, 2, 3]
    attend = rows.attend[0, 0]
    assert attend[6].tolist() == [False, True, True, False, False, False, True]  # sample 1's token: its prompt and itself
    assert attend[5].tolist() == [False, True, True, True, True, True, False]


def test_the_padded_layout_stays_where_it_does_no_more_work(model):
    batch = grouped_batch(model.config.vocab_size)
    distinct = batch.select(*batch.keys())
    distinct["input_ids"] = batch["input_ids"].clone()
    distinct["input_ids"][:, -RESPONSE - 1] = torch.arange(len(batch)) + 3  # every prompt differs in its last token
    assert shared_rows(distinct, model.config.hidden_size) is None


def test_rows_take_as_many_samples_as_cost_least(model):
    """Work per layer is rows * width * (6h + width). Padded: 9 samples of width 11. Shared, prompts
    ending at column 5, 6-token responses, groups of 3, 2 and 4 samples, m samples a row:
    m=2: 5 rows of 17; m=3: 4 of 23; m=4: 3 of 29. At h=64: 39105 padded; 34085, 37444, 35931
    shared: two a row. At h=1: 1683 padded against 1955, 2668, 3045: the padded layout."""
    batch = grouped_batch(model.config.vocab_size, full=True)
    assert _cost(9, 11, 64) == 39105 and _cost(5, 17, 64) == 34085 and _cost(3, 29, 64) == 35931
    rows = shared_rows(batch, hidden_size=64)
    assert rows.input_ids.shape == (5, 17)
    assert shared_rows(batch, hidden_size=1) is None


def test_layouts_it_cannot_match_keep_the_padded_forward(model):
    batch = grouped_batch(model.config.vocab_size)
    holed = batch.select(*batch.keys())
    holed["attention_mask"] = batch["attention_mask"].clone()
    holed["attention_mask"][0, -RESPONSE + 1] = 0  # a response with a hole: not one run from its start
    assert shared_rows(holed, model.config.hidden_size) is None
    empty = batch.select(*batch.keys())
    empty["attention_mask"] = batch["attention_mask"].clone()
    empty["attention_mask"][0, :-RESPONSE] = 0  # a sample without prompt tokens: no column predicts its first token
    assert shared_rows(empty, model.config.hidden_size) is None
    assert applies(model, batch, ("log_probs",))
    assert not applies(model, batch, ("label_log_probs",))
    eager = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager")
    assert not applies(eager, batch, ("log_probs",))
    windowed = copy.deepcopy(model)
    windowed.config.use_sliding_window, windowed.config.sliding_window = True, 4
    assert not applies(windowed, batch, ("log_probs",))
    mixed_layers = copy.deepcopy(model)
    mixed_layers.config.layer_types = ["sliding_attention", "full_attention"]
    assert not applies(mixed_layers, batch, ("log_probs",))


def test_the_update_through_the_worker_equals_the_padded_one(tiny_model_path, monkeypatch):
    import trellis_fsdp.backend

    used = []
    monkeypatch.setattr(trellis_fsdp.backend, "shared_outputs", lambda *a: used.append(shared_outputs(*a)) or used[-1])
    registry = load_plugins().registry
    batch = grouped_batch(AutoModelForCausalLM.from_pretrained(tiny_model_path).config.vocab_size)
    opts = actor_options(registry, micro_batch_samples=5, optim={"lr": 1e-2, "eps": 1e-6, "grad_clip": 1.0})
    shared, padded = (make_worker(registry, tiny_model_path, "actor", opts, OBJECTIVES["actor"], share_prompts=s) for s in ("auto", "off"))
    for _ in range(2):
        got, expected = shared.train("update", batch), padded.train("update", batch)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert_same_weights(shared, padded, atol=1e-5)
    assert any(out is not None for out in used)  # the micro-batches of 5 did share prompts
