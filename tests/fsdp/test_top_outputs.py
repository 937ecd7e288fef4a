"""The top-k forward outputs a distillation loss reads (``top_log_probs`` / ``top_ids`` of a
teacher, ``top_ids_log_probs`` of a student) on the FSDP backend: equal to the model's own
log-softmax, padded or packed, micro-batched at mixed widths; and an update with the
distillation term that moves the student toward its teacher."""

from __future__ import annotations

import pytest
import torch
from test_fsdp_worker import OBJECTIVES, RESPONSE, actor_options, make_worker, prepared_batch
from transformers import AutoModelForCausalLM

from trellis.plugins import load_plugins


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


def by_hand(path: str, batch) -> torch.Tensor:
    """The log-softmax ``(batch, response_len, vocab)`` at the response positions, at the batch's temperature."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
    return torch.log_softmax(logits[:, -RESPONSE - 1 : -1].float() / batch.meta["temperature"], -1)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("top_k", [4, 0])
def test_top_outputs_equal_the_models_log_softmax(registry, tiny_model_path, padding_free, top_k):
    """Micro-batches of 2 samples with their own response widths come back padded to the batch's,
    0 at padding; ``top_k`` 0 returns the whole vocabulary."""
    batch = prepared_batch(tiny_model_path)
    worker = make_worker(registry, tiny_model_path, "actor", actor_options(registry), OBJECTIVES["actor"], padding_free=padding_free)
    expected = by_hand(tiny_model_path, batch)
    k = top_k or expected.shape[-1]
    values, ids = expected.topk(k, -1)
    batch.meta["top_k"] = top_k
    got = worker.forward(batch, ("top_log_probs", "top_ids"))
    mask = batch["response_mask"].bool()
    assert got["top_ids"].shape == (len(batch), RESPONSE, k)
    torch.testing.assert_close(got["top_log_probs"][mask], values[mask], atol=1e-5, rtol=0)
    assert (got["top_ids"][mask] == ids[mask]).float().mean() > 0.99  # ties may order apart
    assert (got["top_log_probs"][~mask] == 0).all()
    batch["top_ids"] = torch.randint(0, expected.shape[-1], (len(batch), RESPONSE, 5), generator=torch.Generator().manual_seed(3))
    at = worker.forward(batch, ("top_ids_log_probs",))["top_ids_log_probs"]
    torch.testing.assert_close(at[mask], expected.gather(-1, batch["top_ids"])[mask], atol=1e-5, rtol=0)


def test_the_distillation_term_is_zero_against_itself_and_moves_the_student_toward_a_teacher(registry, tiny_model_path):
    """The student as its own teacher: a zero divergence. Toward another teacher (the same model at
    another temperature, its whole vocabulary), the distillation term alone (no policy loss)
    falls step after step."""
    batch = prepared_batch(tiny_model_path)
    options = actor_options(registry, distill={"coef": 1.0, "use_policy_loss": False}, optim={"lr": 3e-3, "grad_clip": 1.0})
    student = make_worker(registry, tiny_model_path, "actor", options, OBJECTIVES["actor"])
    batch.meta["top_k"] = 0
    own = student.forward(batch, ("top_log_probs", "top_ids"))
    batch["top_ids"], batch["teacher_top_log_probs"] = own["top_ids"], own["top_log_probs"]
    first = student.train("update", batch)
    assert first["actor/distill_loss"] == pytest.approx(0.0, abs=1e-6) and "actor/pg_loss" not in first

    fresh = make_worker(registry, tiny_model_path, "actor", options, OBJECTIVES["actor"])
    teacher = batch.select(*batch.keys())
    teacher.meta = {**batch.meta, "temperature": 0.3}  # a sharper distribution than the student's 0.7
    other = fresh.forward(teacher, ("top_log_probs", "top_ids"))
    batch["top_ids"], batch["teacher_top_log_probs"] = other["top_ids"], other["top_log_probs"]
    losses = [fresh.train("update", batch)["actor/distill_loss"] for _ in range(5)]
    assert losses[0] > 0.01 and all(b < a for a, b in zip(losses, losses[1:])), losses
