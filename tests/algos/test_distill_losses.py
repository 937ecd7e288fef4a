"""The distillation divergences (kind ``distill_loss``) against hand-derived values on a 3-token
vocabulary, their gradients against the KL's closed form, the top-k buckets (exact at k = the
vocabulary, a lower bound below it), and the actor's loss term built from them."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from trellis.batch import Batch
from trellis.config import ConfigError, validate
from trellis.interfaces.hf import log_probs_at, top_log_probs
from trellis.plugins import load_plugins
from trellis_algos import ActorConfig
from trellis_algos.distill_losses import JSDOptions, forward_kl, jsd, reverse_kl, top_k_buckets

P = [0.5, 0.3, 0.2]  # the student
Q = [0.2, 0.5, 0.3]  # the teacher


def logs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


def test_each_divergence_equals_its_hand_derived_value():
    p, q = logs(P), logs(Q)
    kl_pq = 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.5) + 0.2 * math.log(0.2 / 0.3)
    kl_qp = 0.2 * math.log(0.2 / 0.5) + 0.5 * math.log(0.5 / 0.3) + 0.3 * math.log(0.3 / 0.2)
    assert float(reverse_kl(p, q)) == pytest.approx(kl_pq, abs=1e-12)
    assert float(forward_kl(p, q)) == pytest.approx(kl_qp, abs=1e-12)
    # beta 0.25: m = 0.25 q + 0.75 p = [0.425, 0.35, 0.225]
    m = [0.425, 0.35, 0.225]
    kl_qm = sum(b * math.log(b / c) for b, c in zip(Q, m))
    kl_pm = sum(a * math.log(a / c) for a, c in zip(P, m))
    assert float(jsd(p, q, JSDOptions(beta=0.25))) == pytest.approx(0.25 * kl_qm + 0.75 * kl_pm, abs=1e-12)


@pytest.mark.parametrize("fn", [reverse_kl, forward_kl, jsd])
def test_every_divergence_is_zero_when_student_equals_teacher_and_positive_otherwise(fn):
    p, q = logs(P), logs(Q)
    assert float(fn(p, p.clone())) == pytest.approx(0.0, abs=1e-15)
    assert float(fn(p, q)) > 1e-3


def test_the_exact_reverse_kl_gradient_equals_the_closed_form():
    """``d KL(p || q) / d z_i = p_i (log p_i - log q_i - KL)`` for student logits ``z``; the loss
    as trained (the student's log-probs at the teacher's ids, all of them) has that gradient."""
    torch.manual_seed(0)
    z = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    q = torch.log_softmax(torch.randn(4, 7, dtype=torch.float64), -1)
    values, ids = top_log_probs(q, 0)  # the teacher's whole vocabulary, sorted
    student = log_probs_at(z, ids)
    loss = reverse_kl(*top_k_buckets(student, values, whole_vocabulary=True)).sum()
    loss.backward()
    log_p = torch.log_softmax(z.detach(), -1)
    kl = (log_p.exp() * (log_p - q)).sum(-1, keepdim=True)
    torch.testing.assert_close(z.grad, log_p.exp() * (log_p - q - kl), atol=1e-12, rtol=0)


@pytest.mark.parametrize("fn", [reverse_kl, forward_kl, jsd])
def test_top_k_at_the_vocabulary_size_equals_the_exact_loss_and_below_it_is_a_lower_bound(fn):
    torch.manual_seed(1)
    z, t = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    exact = fn(torch.log_softmax(z, -1), torch.log_softmax(t, -1))
    for whole in (True, False):  # k = vocabulary with or without the (empty) tail bucket
        values, ids = top_log_probs(t, 6)
        got = fn(*top_k_buckets(log_probs_at(z, ids), values, whole_vocabulary=whole))
        torch.testing.assert_close(got, exact, atol=1e-9, rtol=0)
    values, ids = top_log_probs(t, 3)
    lumped = fn(*top_k_buckets(log_probs_at(z, ids), values, whole_vocabulary=False))
    assert (lumped <= exact + 1e-12).all() and (lumped < exact - 1e-6).any()


def test_top_k_lumps_the_tail_into_one_bucket_by_hand():
    """Vocabulary of 4, k = 2: the teacher's top ids 1, 2; the other two tokens form one bucket."""
    student = logs([0.1, 0.2, 0.3, 0.4])
    teacher = logs([0.05, 0.6, 0.25, 0.1])
    values, ids = top_log_probs(teacher, 2)
    assert ids.tolist() == [1, 2]
    p, q = top_k_buckets(log_probs_at(student, ids), values, whole_vocabulary=False)
    expected = 0.2 * math.log(0.2 / 0.6) + 0.3 * math.log(0.3 / 0.25) + 0.5 * math.log(0.5 / 0.15)
    assert float(reverse_kl(p, q)) == pytest.approx(expected, abs=1e-12)


def distill_batch(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int) -> Batch:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    values, ids = top_log_probs(teacher_logits, k)
    log_probs = torch.log_softmax(student_logits, -1)
    sampled = torch.zeros(2, 3, dtype=torch.long)
    return Batch({
        "responses": sampled, "response_mask": mask, "advantages": torch.ones(2, 3) * mask,
        "old_log_probs": log_probs[..., 0].detach(), "top_ids": ids, "teacher_top_log_probs": values,
    })  # fmt: skip


@pytest.mark.parametrize("use_policy_loss", [True, False])
def test_the_actor_loss_adds_coef_times_the_token_mean_divergence(registry, use_policy_loss):
    torch.manual_seed(2)
    student, teacher = torch.randn(2, 3, 5, requires_grad=True), torch.randn(2, 3, 5)
    batch = distill_batch(student, teacher, 0)
    options = validate(OmegaConf.create({"distill": {"coef": 0.5, "use_policy_loss": use_policy_loss}}), ActorConfig, registry)
    objective = registry.get("objective", "policy").obj(options, registry)
    assert "top_ids_log_probs" in objective.outputs and {"top_ids", "teacher_top_log_probs"} <= set(objective.inputs)
    log_probs = torch.log_softmax(student, -1)
    outputs = {"log_probs": log_probs[..., 0], "top_ids_log_probs": log_probs.gather(-1, batch["top_ids"])}
    loss, metrics = objective.loss(batch, outputs, objective.counts(batch))
    per_token = reverse_kl(log_probs, torch.log_softmax(teacher, -1))
    divergence = float((per_token * batch["response_mask"]).sum().detach() / 5)
    assert metrics["distill_loss"] == pytest.approx(divergence, rel=1e-5)
    # the vanilla policy loss at ratio 1 with advantage 1 is -1 per token
    assert float(loss.detach()) == pytest.approx(0.5 * divergence - (1.0 if use_policy_loss else 0.0), rel=1e-5)
    assert ("pg_loss" in metrics) is use_policy_loss


def test_distillation_options_are_refused_while_its_coefficient_is_zero(registry):
    for section in ({"top_k": 16}, {"loss": {"name": "jsd"}}, {"use_policy_loss": False}):
        with pytest.raises(
            ConfigError, match=r"distill\.\w+' is set .* but distill\.coef is 0\.0, so it would be ignored; set distill\.coef above 0"
        ):
            validate(OmegaConf.create({"distill": section}), ActorConfig, registry)
    with pytest.raises(ConfigError, match=r"beta"):
        validate(OmegaConf.create({"distill": {"coef": 1.0, "loss": {"name": "jsd", "beta": 1.0}}}), ActorConfig, registry)


def test_top_k_ids_of_one_position_are_its_most_likely_tokens_in_order():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    values, ids = top_log_probs(logits, 3, chunk_size=1)
    assert ids.tolist() == [[1, 3, 2]]
    torch.testing.assert_close(values, torch.log_softmax(logits, -1)[:, [1, 3, 2]])


def test_masked_positions_do_not_count(registry):
    """Environment tokens of a multi-turn sample (response mask 0) and padding leave the term: a
    teacher that differs only there gives the same loss and gradient."""
    torch.manual_seed(3)
    student, teacher = torch.randn(2, 3, 5, requires_grad=True), torch.randn(2, 3, 5)
    options = validate(OmegaConf.create({"distill": {"coef": 1.0, "use_policy_loss": False}}), ActorConfig, registry)
    objective = registry.get("objective", "policy").obj(options, registry)
    losses, grads = [], []
    for shift in (0.0, 5.0):
        batch = distill_batch(student, teacher, 0)
        batch["teacher_top_log_probs"] = torch.where(
            batch["response_mask"].bool()[..., None], batch["teacher_top_log_probs"], batch["teacher_top_log_probs"] - shift
        )
        log_probs = torch.log_softmax(student, -1)
        outputs = {"log_probs": log_probs[..., 0], "top_ids_log_probs": log_probs.gather(-1, batch["top_ids"])}
        loss, _ = objective.loss(batch, outputs, objective.counts(batch))
        (grad,) = torch.autograd.grad(loss, student)
        losses.append(float(loss.detach()))
        grads.append(grad)
    assert losses[0] == pytest.approx(losses[1], abs=1e-7) and losses[0] > 0
    torch.testing.assert_close(grads[0], grads[1])
