"""How a mini-batch is cut into micro-batches (samples per micro-batch, or a token budget) leaves
its loss and gradient unchanged, with each loss aggregation mode, for the policy and SFT
objectives, through core's role worker on the tests-only plain backend."""

from __future__ import annotations

from itertools import chain

import pytest
import torch
from omegaconf import OmegaConf
from test_fsdp_worker import OBJECTIVES, PROMPT, RESPONSE, SAMPLES, make_worker, reference_log_probs, rl_batch
from transformers import AutoModelForCausalLM

from trellis.config import validate
from trellis.interfaces.signatures import AGG_MODES, Aggregation, PolicyLossInputs
from trellis.plugins import load_plugins
from trellis_algos import ActorConfig, SFTTrainConfig
from trellis_algos.policy_losses import VanillaOptions, vanilla
from trellis_plain import PlainBackend

# every response shorter than the batch's width: a micro-batch is trimmed to its longest
LENGTHS = torch.tensor([1, 3, 5, 2, 4, 1, 5, 2])
CUTS = [{"micro_batch_samples": 1}, {"micro_batch_samples": 3}, {"micro_batch_samples": SAMPLES}, {"max_tokens_per_micro_batch": 20}]


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    """The RL batch with old and reference log-probs a little off the model's own."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    batch = rl_batch(model.config.vocab_size, response_lengths=LENGTHS)
    with torch.no_grad():
        lp = reference_log_probs(model, batch)
    noise = torch.randn((2, *lp.shape), generator=torch.Generator().manual_seed(1)) * batch["response_mask"]
    batch["old_log_probs"] = lp + 0.3 * noise[0]
    batch["ref_log_probs"] = lp + 0.1 * noise[1]
    batch["loss_mask"] = torch.cat([torch.zeros(SAMPLES, PROMPT, dtype=torch.long), batch["response_mask"]], 1)
    return batch


def step(registry, path, role, batch, mode, cut):
    """One update of a fresh worker: its metrics and weights after the step."""
    # Adam's eps at 1e-3: a gradient of pure rounding noise would otherwise move its weight by +-lr
    base = {"optim": {"lr": 1e-2, "eps": 1e-3}, "loss_agg_mode": mode, **cut}
    if role == "sft":
        opts = validate(OmegaConf.create(base), SFTTrainConfig, registry)
        worker = make_worker(registry, path, "actor", opts, OBJECTIVES["sft"], backend=PlainBackend)
        metrics = worker.train("sft_update", batch.select("input_ids", "attention_mask", "position_ids", "loss_mask"))
    else:
        extra = {"entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_type": "k1", "kl_loss_coef": 0.1}
        opts = validate(OmegaConf.create({**base, **extra}), ActorConfig, registry)
        worker = make_worker(registry, path, "actor", opts, OBJECTIVES["actor"], backend=PlainBackend)
        metrics = worker.train("update", batch)
    return metrics, dict(chain.from_iterable(worker.export_weights()))


def expected_loss(path, role, batch, mode) -> float:
    """The mini-batch's loss in one piece, written out: Dr. GRPO's divisor is the batch's full
    label width (RESPONSE for the policy, the sequence length less one for SFT)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        if role == "sft":
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
            labels = batch["input_ids"][:, 1:]
            token = out.logits[:, :-1].log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            mask = batch["loss_mask"][:, 1:].float()
            per_seq = (-token * mask).sum(-1)
            if mode == "token-mean":
                return float(per_seq.sum() / mask.sum())
            return float((per_seq / (PROMPT + RESPONSE - 1)).mean())
        data = PolicyLossInputs(reference_log_probs(model, batch), batch["old_log_probs"], batch["advantages"], batch["response_mask"])
        agg = Aggregation(mode, global_tokens=float(LENGTHS.sum()), global_seqs=SAMPLES, norm_constant=RESPONSE)
        return float(vanilla(data, agg, VanillaOptions())[0])


@pytest.mark.parametrize("role", ["actor", "sft"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_the_cut_into_micro_batches_leaves_loss_and_gradient_unchanged(registry, tiny_model_path, batch, role, mode):
    loss_key, norm_key = (f"{role}/pg_loss", f"{role}/grad_norm") if role == "actor" else ("sft/loss", "sft/grad_norm")
    results = [step(registry, tiny_model_path, role, batch, mode, cut) for cut in CUTS]
    if mode in ("token-mean", "seq-mean-token-sum-norm"):
        assert results[0][0][loss_key] == pytest.approx(expected_loss(tiny_model_path, role, batch, mode), abs=1e-6)
    (first, weights), rest = results[0], results[1:]
    for cut, (metrics, other) in zip(CUTS[1:], rest):
        assert metrics[loss_key] == pytest.approx(first[loss_key], rel=1e-6, abs=1e-6), cut
        assert metrics[norm_key] == pytest.approx(first[norm_key], rel=1e-5), cut
        for name, tensor in weights.items():
            torch.testing.assert_close(other[name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name, c=cut: f"{c} {n}: {m}")
