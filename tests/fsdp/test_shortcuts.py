"""Every speed shortcut of the training side against its slow path, on the FSDP backend and the
tests-only plain backend: the on-policy update (old log-probs from its own first forward),
padding-free packed forwards, foreach AdamW, chunked log-probs, and optimizer/parameter offload.
Same losses, gradient norms and weights."""

from __future__ import annotations

from itertools import chain

import pytest
import torch
from omegaconf import OmegaConf
from test_fsdp_worker import OBJECTIVES, PROMPT, SAMPLES, actor_options, make_worker, prepared_batch
from torch.distributed.tensor import DTensor

from trellis.config import validate
from trellis.interfaces.hf import token_log_probs
from trellis.plugins import load_plugins
from trellis_algos import CriticConfig, SFTTrainConfig
from trellis_fsdp.backend import FSDPBackend
from trellis_plain import PlainBackend


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


def weights(worker) -> dict[str, torch.Tensor]:
    return dict(chain.from_iterable(worker.export_weights()))


def assert_same_weights(a, b, atol=0.0):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend", [FSDPBackend, PlainBackend], ids=["fsdp", "plain"])
@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01])
def test_on_policy_update_equals_log_prob_pass_then_update(registry, tiny_model_path, backend, entropy_coeff):
    """Without old_log_probs the update takes them from its own first forward, detached: the same
    loss, grad norm and weights as a log_prob pass then the update, bit for bit, and the entropy
    the pass would have reported."""
    batch = prepared_batch(tiny_model_path)
    del batch.tensors["old_log_probs"]
    opts = actor_options(registry, entropy_coeff=entropy_coeff)
    slow, fast = (make_worker(registry, tiny_model_path, "actor", opts, OBJECTIVES["actor"], backend=backend) for _ in range(2))
    old = slow.log_prob(batch, with_entropy=True)
    with_old = batch.select(*batch.keys())
    with_old["old_log_probs"] = old["log_probs"]
    expected = slow.train("update", with_old)
    got = fast.train("update", batch)
    mask = batch["response_mask"].float()
    assert got.pop("actor/entropy") == pytest.approx(float((old["entropy"] * mask).sum() / mask.sum()), rel=1e-6)
    assert got == expected
    assert_same_weights(fast, slow)


def test_on_policy_update_refuses_several_optimizer_steps(registry, tiny_model_path):
    batch = prepared_batch(tiny_model_path)
    del batch.tensors["old_log_probs"]
    worker = make_worker(registry, tiny_model_path, "actor", actor_options(registry, mini_batch_samples=4), OBJECTIVES["actor"])
    with pytest.raises(ValueError, match=r"mini_batch_samples=4 for 8 samples; compute them first"):
        worker.train("update", batch)


@pytest.mark.parametrize("backend", [FSDPBackend, PlainBackend], ids=["fsdp", "plain"])
def test_padding_free_forwards_equal_padded_ones(registry, tiny_model_path, backend, monkeypatch):
    """Packed (one sequence of every attended token, block-diagonal attention) against padded: the
    log-probs, entropies and values at real tokens, and the PPO, critic and SFT updates."""
    if backend is PlainBackend:  # the plain backend has no options: pack every forward it runs
        import trellis_plain
        from trellis.interfaces import hf

        monkeypatch.setattr(trellis_plain, "forward_outputs", lambda *a, **k: hf.forward_outputs(*a, **k, padding_free=pack))
    batch = prepared_batch(tiny_model_path)
    batch["returns"] = torch.randn(batch["response_mask"].shape) * batch["response_mask"]
    batch["values"] = torch.zeros_like(batch["returns"])
    batch["loss_mask"] = torch.cat([torch.zeros(SAMPLES, PROMPT, dtype=torch.long), batch["response_mask"]], 1)
    # AdamW's eps raised from 1e-8 to 1e-6: a weight whose gradient is rounding noise (~1e-9, its
    # sign changed by any reordering of sums) would otherwise move by up to +-lr on that noise alone
    optim = {"lr": 1e-2, "eps": 1e-6, "grad_clip": 1.0}
    critic_opts = validate(OmegaConf.create({"micro_batch_samples": 4, "optim": optim}), CriticConfig, registry)
    sft_opts = validate(OmegaConf.create({"micro_batch_samples": 4, "optim": optim}), SFTTrainConfig, registry)
    results = []
    for pack in (False, True):
        opts = {"padding_free": pack} if backend is FSDPBackend else {}
        actor = make_worker(registry, tiny_model_path, "actor", actor_options(registry, optim=optim), OBJECTIVES["actor"], backend=backend, **opts)
        critic = make_worker(registry, tiny_model_path, "critic", critic_opts, OBJECTIVES["critic"], backend=backend, head="value", **opts)
        sft = make_worker(registry, tiny_model_path, "actor", sft_opts, OBJECTIVES["sft"], backend=backend, **opts)
        results.append({
            "log_prob": actor.log_prob(batch, with_entropy=True, with_sum_sq_probs=True),
            "values": critic.values(batch)["values"],
            "actor": actor.train("update", batch), "critic": critic.train("update", batch),
            "sft": sft.train("sft_update", batch), "sft_eval": sft.evaluate("sft_update", batch),
            "workers": (actor, critic, sft),
        })  # fmt: skip
    padded, packed = results
    for key in ("log_probs", "entropy", "sum_sq_probs"):
        torch.testing.assert_close(packed["log_prob"][key], padded["log_prob"][key], atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(packed["values"], padded["values"], atol=2e-6, rtol=0)
    for verb in ("actor", "critic", "sft", "sft_eval"):
        assert packed[verb].keys() == padded[verb].keys()
        for k, v in padded[verb].items():
            assert packed[verb][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (verb, k)
    for a, b in zip(packed["workers"], padded["workers"]):
        assert_same_weights(a, b, atol=1e-5)


def test_padding_free_refuses_positions_that_do_not_start_at_zero(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from trellis.interfaces.hf import forward_outputs

    batch = prepared_batch(tiny_model_path)
    batch["position_ids"] = batch["position_ids"] + 1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with pytest.raises(ValueError, match=r"padding_free packs samples by their position_ids, which must start at 0 .* or set padding_free=false"):
        forward_outputs(model, batch, ("log_probs",), "lm", padding_free=True)


def test_foreach_adamw_equals_the_per_tensor_loop(registry, tiny_model_path):
    batch = prepared_batch(tiny_model_path)
    loop, foreach = (
        make_worker(registry, tiny_model_path, "actor", actor_options(registry), OBJECTIVES["actor"], optimizer=impl)
        for impl in ("per_tensor", "foreach")
    )
    assert foreach.backend.optimizer.defaults["foreach"] and not loop.backend.optimizer.defaults["foreach"]
    for _ in range(3):
        assert foreach.train("update", batch) == loop.train("update", batch)
    assert_same_weights(foreach, loop)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A shard's own tensor (one rank holds plain tensors; FSDP2's are DTensors)."""
    return t.to_local() if isinstance(t, DTensor) else t


def test_offloaded_optimizer_and_params_come_back_bit_for_bit(registry, tiny_model_path):
    """offload frees the storage of every shard and optimizer-state tensor (resized to 0 bytes);
    onload refills it; training goes on exactly as if nothing had moved."""
    batch = prepared_batch(tiny_model_path)
    opts = actor_options(registry)
    moved = make_worker(registry, tiny_model_path, "actor", opts, OBJECTIVES["actor"], offload_optimizer=True, offload_params=True)
    still = make_worker(registry, tiny_model_path, "actor", opts, OBJECTIVES["actor"])
    for _ in range(2):
        assert moved.train("update", batch) == still.train("update", batch)
        moved.offload()
        optim = [v for s in moved.backend.optimizer.state.values() for v in s.values() if v.dim() > 0]
        assert optim and all(_local(v).untyped_storage().nbytes() == 0 for v in optim)
        assert all(_local(p).untyped_storage().nbytes() == 0 for p in moved.backend.params)
        moved.onload()
    assert_same_weights(moved, still)


@pytest.mark.parametrize("padding_free,masked_logits", [(False, True), (False, False), (True, None)])
def test_sft_log_probs_only_at_loss_positions_equal_the_full_forward(tiny_model_path, padding_free, masked_logits, monkeypatch):
    """With a loss_mask only the positions predicting a loss token go through the LM head: the
    label log-probs there, and the gradient of their masked sum, equal those of every position.
    ``masked_logits=False``: what transformers before 5.21 allows (no boolean ``logits_to_keep``;
    vLLM 0.32 pins < 5.20), the columns any row needs; a packed row never uses a mask (None)."""
    from transformers import AutoModelForCausalLM

    from trellis.interfaces import hf
    from trellis.interfaces.hf import forward_outputs

    if masked_logits and not hf.MASKED_LOGITS:
        pytest.skip("this transformers takes no boolean logits_to_keep (5.21 on)")
    if masked_logits is not None:
        monkeypatch.setattr(hf, "MASKED_LOGITS", masked_logits)

    batch = prepared_batch(tiny_model_path)
    loss_mask = torch.cat([torch.zeros(SAMPLES, PROMPT, dtype=torch.long), batch["response_mask"]], 1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    results = []
    for micro in (batch.select("input_ids", "attention_mask", "position_ids"), batch.select("input_ids", "attention_mask", "position_ids")):
        if len(results):
            micro["loss_mask"] = loss_mask
        lp = forward_outputs(model, micro, ("label_log_probs",), "lm", padding_free=padding_free)["label_log_probs"]
        masked = lp * loss_mask[:, 1:]
        grads = torch.autograd.grad(masked.sum(), list(model.parameters()))
        results.append((masked.detach(), grads))
    (full, full_grads), (kept, kept_grads) = results
    torch.testing.assert_close(kept, full, atol=1e-6, rtol=1e-6)
    for a, b in zip(kept_grads, full_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_chunked_log_probs_equal_log_softmax_with_gradient():
    """gather - logsumexp over chunks of rows, checkpointed, against log_softmax over the whole
    (rows, vocab) tensor: values and gradients."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 50, generator=g) * 4).requires_grad_()
    tokens = torch.randint(0, 50, (3, 7), generator=g)
    whole = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (grad_whole,) = torch.autograd.grad(whole.sum(), logits)
    for chunk in (None, 4, 100):
        chunked = token_log_probs(logits, tokens, chunk, temperature=0.7)
        (grad,) = torch.autograd.grad(chunked.sum(), logits)
        torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grad, grad_whole, atol=1e-6, rtol=1e-6)
