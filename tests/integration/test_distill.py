"""On-policy distillation in the ``rl`` recipe (advantage ``reverse_kl_teacher``, and the actor's
loss term ``actor.distill``): a teacher from another folder with the same tokenizer pulls the
student's reverse KL down (the exact loss further than the sampled-token advantage), a teacher
identical to the student gives zero advantage, and a teacher with another tokenizer is refused
naming both."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.config import ConfigError
from trellis_demo.tasks import make_arithmetic_split, write_rows
from trellis_demo.tiny import make_tiny_model

DISTILL = ("algorithm.advantage.name=reverse_kl_teacher",)


def test_a_teacher_identical_to_the_student_gives_zero_advantage(run_rl, tiny_model_path, step_batches):
    _, rows = run_rl(*DISTILL, f"teacher.path={tiny_model_path}", "trainer.total_steps=1")
    step = next(r for r in rows if "actor/pg_loss" in r)
    assert step["teacher/reverse_kl"] == 0.0 and step["actor/pg_loss"] == 0.0
    batch = step_batches[0]
    assert batch["response_mask"].sum() > 0 and batch["advantages"].abs().sum() == 0
    assert batch["teacher_log_probs"].abs().sum() > 0  # a real forward, equal to the student's


def exact_reverse_kl(student, teacher, sequences: torch.Tensor, prompt_len: int) -> float:
    """KL(student || teacher) over the whole vocabulary, averaged over the response positions of
    ``sequences`` ``(batch, len)``."""
    with torch.no_grad():
        p, q = (m(sequences).logits[:, prompt_len - 1 : -1].log_softmax(-1) for m in (student, teacher))
    return float((p.exp() * (p - q)).sum(-1).mean())


def held_out_reverse_kl(tiny_model_path, teacher_path, trained_path) -> tuple[float, float]:
    """The exact KL(student || teacher) on fixed samples of the initial student, before and after."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    before, teacher = (AutoModelForCausalLM.from_pretrained(p) for p in (tiny_model_path, teacher_path))
    prompts = tokenizer(["1+2=", "13+4=", "20+31=", "7+7="], return_tensors="pt", padding=True).input_ids
    torch.manual_seed(0)
    sequences = before.generate(prompts, do_sample=True, max_new_tokens=6, num_return_sequences=8, pad_token_id=tokenizer.pad_token_id)
    start = exact_reverse_kl(before, teacher, sequences, prompts.shape[1])
    return start, exact_reverse_kl(AutoModelForCausalLM.from_pretrained(trained_path), teacher, sequences, prompts.shape[1])


SHORT_RUN = ("data.train_batch_prompts=16", "actor.optim.lr=3e-3", "actor.micro_batch_samples=64", "trainer.total_steps=12",
             "trainer.save_hf_model=true", "validation.before_train=false", "data.val_path=null")  # fmt: skip


def test_the_reverse_kl_falls_further_with_the_exact_loss_than_with_the_sampled_advantage(
    run_rl, tiny_model_path, tiny_untied_model_path, tmp_path, caplog
):
    """Two random tiny models with one tokenizer; enough samples a step for the KL to move. The KL
    is measured exactly (full vocabulary) on fixed samples of the initial student: the logged
    ``teacher/reverse_kl`` is a one-batch sample estimate, too noisy at this scale to compare. The
    sampled-token advantage lowers it; the loss term ``actor.distill`` (the whole vocabulary, no
    policy loss) lowers it further, and logs the exact KL on the step's samples. Every reward is 0
    (random models): no warning may say the policy learns nothing."""
    with caplog.at_level(logging.WARNING, logger="trellis"):
        _, sampled_rows = run_rl(*DISTILL, f"teacher.path={tiny_untied_model_path}", *SHORT_RUN, run_dir=tmp_path / "sampled")
        _, rows = run_rl(f"teacher.path={tiny_untied_model_path}", "actor.distill.coef=1.0", "actor.distill.use_policy_loss=false",
                         *SHORT_RUN, run_dir=tmp_path / "exact")  # fmt: skip
    assert len([r for r in sampled_rows if "teacher/reverse_kl" in r]) == 12
    assert all(r["reward/groups_with_signal"] == 0.0 for r in sampled_rows if "teacher/reverse_kl" in r)
    assert not [r.getMessage() for r in caplog.records if "learns nothing" in r.getMessage()]
    steps = [r for r in rows if "actor/distill_loss" in r]
    assert len(steps) == 12 and "actor/pg_loss" not in steps[0]
    assert steps[0]["actor/distill_loss"] == pytest.approx(steps[0]["teacher/reverse_kl"], abs=0.01)
    start, exact = held_out_reverse_kl(tiny_model_path, tiny_untied_model_path, tmp_path / "exact" / "hf_model")
    _, sampled = held_out_reverse_kl(tiny_model_path, tiny_untied_model_path, tmp_path / "sampled" / "hf_model")
    # measured: 0.0135 -> 0.0083 sampled, 0.0061 exact
    assert sampled < 0.75 * start and exact < 0.85 * sampled, (start, sampled, exact)


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(run_rl, tiny_model_path, tmp_path):
    other = make_tiny_model(tmp_path / "other", ["a different corpus", "gives different merges"], hidden_size=32, num_layers=2)
    with pytest.raises(ConfigError, match=rf"'teacher.path' is '{other}', whose tokenizer differs from the actor's in '{tiny_model_path}'"):
        run_rl(*DISTILL, f"teacher.path={other}")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (DISTILL, "'teacher.path' is empty, but advantage 'reverse_kl_teacher' scores"),
        (("teacher.path=/some/model",), "'teacher.path' is '/some/model', but advantage 'grpo' reads no teacher log-probs"),
        (("actor.distill.coef=1.0",), "'teacher.path' is empty, but actor.distill.coef > 0 compares"),
    ],
)
def test_a_teacher_exactly_when_the_advantage_reads_one(run_rl, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_rl(*overrides)


def test_multi_turn_environment_tokens_get_no_advantage(run_rl, tiny_untied_model_path, tmp_path, step_batches):
    """Conversations of two model turns around the interaction's feedback: the feedback tokens
    (response mask 0) inside the response get 0, every model token its own log-ratio."""
    train_file = write_rows(make_arithmetic_split(16, 0, max_value=30, interaction="gsm8k"), tmp_path / "train.parquet")
    run_rl(
        *DISTILL,
        f"teacher.path={tiny_untied_model_path}",
        f"data.train_path={train_file}",
        "data.val_path=null",
        "trainer.total_steps=1",
        "multi_turn.enable=true",
        "multi_turn.max_assistant_turns=2",
        "multi_turn.max_user_turns=1",
        "multi_turn.max_response_tokens=48",
        "multi_turn.interactions=[{name: gsm8k, component: gsm8k}]",
    )
    batch = step_batches[0]
    mask = batch["response_mask"].bool()
    # an environment token between model tokens: a 0 in the mask followed by a 1 later in the row
    inside = ~mask & (mask.flip(-1).cummax(-1).values.flip(-1))
    assert inside.any()
    assert batch["advantages"][~mask].abs().sum() == 0
    expected = -(batch["old_log_probs"] - batch["teacher_log_probs"])
    assert torch.allclose(batch["advantages"][mask], expected[mask])


@pytest.mark.parametrize("use_policy_loss", [True, False])
def test_one_sample_a_prompt_is_warned_about_only_when_the_policy_loss_reads_the_advantages(run_rl, tiny_untied_model_path, caplog, use_policy_loss):
    """The preset's n=1 with grpo's (unused) advantages: no warning that every advantage is 0."""
    with caplog.at_level(logging.WARNING, logger="trellis"):
        run_rl(f"teacher.path={tiny_untied_model_path}", "actor.distill.coef=1.0", f"actor.distill.use_policy_loss={use_policy_loss}",
               "sampling.n=1", "trainer.total_steps=1", "validation.before_train=false", "data.val_path=null")  # fmt: skip
    warned = any("every advantage is 0" in r.getMessage() for r in caplog.records)
    assert warned is use_policy_loss
