"""Training clients through the real tinker SDK against ``trellis serve`` over HTTP: Tinker's
next-token alignment, each loss against its formula, gradients and the AdamW step against the same
work done by hand on the Hugging Face model, LoRA and full fine-tuning side by side."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from served import MODEL, UNTIED

tinker = pytest.importorskip("tinker")
types = tinker.types


def datum(tokens, targets, **inputs):
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens)), loss_fn_inputs={"target_tokens": list(targets), **inputs})


def mixed_datums():
    """Three datums of different lengths whose targets are not the next inputs (so an off-by-one
    shows), with weights that are 0 at the first and last target of one of them."""
    return [
        datum([5, 9, 14, 3, 7], [11, 2, 30, 8, 4], weights=[0.0, 1.0, 0.5, 2.0, 0.0]),
        datum([12], [6], weights=[1.0]),
        datum([40, 41, 42], [43, 44, 45], weights=[1.0, 1.0, 1.0]),
    ]


def hf_target_logprobs(model, data) -> list[torch.Tensor]:
    """log p(target_i | input[: i + 1]) by a plain Hugging Face forward of each datum alone."""
    out = []
    for d in data:
        ids = torch.tensor([d.model_input.to_ints()])
        logits = model(input_ids=ids).logits[0].float()
        targets = torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())
        out.append(torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0])
    return out


def sampler_weights(server, path: str) -> dict[str, torch.Tensor]:
    run, _, name = path.removeprefix("tinker://").split("/")
    return load_file(str(server.root / run.replace(":", "__") / "sampler_weights" / name / "model.safetensors"))


def test_cross_entropy_alignment_gradients_and_adamw_step_equal_a_hand_computed_step(service_client, server, tiny_model_path):
    from transformers import AutoModelForCausalLM

    client = service_client.create_lora_training_client(base_model=MODEL, rank=0).result()  # rank 0: full fine-tuning
    assert client.get_info().is_lora is False
    data = mixed_datums()
    result = client.forward_backward(data, "cross_entropy").result()
    adam = types.AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.5)
    step = client.optim_step(adam).result()
    after = sampler_weights(server, client.save_weights_for_sampler("after-one-step").result().path)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    expected = hf_target_logprobs(model, data)
    for got, want in zip(result.loss_fn_outputs, expected):
        np.testing.assert_allclose(got["logprobs"].to_numpy(), want.detach().numpy(), rtol=0, atol=2e-5)
    weights = [torch.tensor(d.loss_fn_inputs["weights"].tolist()) for d in data]
    loss = -sum((lp * w).sum() for lp, w in zip(expected, weights))
    assert result.metrics["loss:sum"] == pytest.approx(loss.item(), rel=1e-5)

    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), adam.grad_clip_norm)
    assert step.metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    opt.step()
    state = model.state_dict()
    # Adam divides by sqrt(v): where a gradient is ~eps, float rounding of the gradient moves the
    # update by a few 1e-6 (lr 1e-2); an alignment or gradient error would move it by ~lr
    for name, tensor in after.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")


def policy_datums(rng):
    data = []
    for n in (6, 3):
        tokens, targets = rng.integers(3, 60, n).tolist(), rng.integers(3, 60, n).tolist()
        data.append(datum(tokens, targets, logprobs=(-rng.uniform(2, 6, n)).tolist(), advantages=rng.normal(0, 1, n).tolist()))
    return data


def expected_policy_loss(loss_fn: str, logp: np.ndarray, old: np.ndarray, adv: np.ndarray, config: dict) -> float:
    """Each Tinker loss's formula, summed over the datum's targets."""
    ratio = np.exp(logp - old)
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if loss_fn == "importance_sampling":
        return float(-(ratio * adv).sum())
    if loss_fn == "ppo":
        return float(-np.minimum(ratio * adv, np.clip(ratio, low, high) * adv).sum())
    if loss_fn == "cispo":
        return float(-(np.clip(ratio, low, high) * adv * logp).sum())
    if loss_fn == "dro":
        return float(-(logp * adv - 0.5 * config["beta"] * (logp - old) ** 2).sum())
    seq = np.exp((logp - old).mean())  # gspo: one sequence ratio, clipped to trellis's default (3e-4, 4e-4) range
    return float(np.maximum(-adv * seq, -adv * np.clip(seq, 1 - 3e-4, 1 + 4e-4)).sum())


@pytest.mark.parametrize(
    "loss_fn, config",
    [
        ("importance_sampling", {}),
        ("ppo", {}),
        ("ppo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.01}),
        ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.05}),
        ("dro", {"beta": 0.3}),
        ("gspo", {}),
    ],
)
def test_policy_losses_equal_their_formulas(service_client, loss_fn, config):
    client = service_client.create_lora_training_client(base_model=MODEL, rank=4, train_unembed=False).result()
    data = policy_datums(np.random.default_rng(0))
    result = client.forward(data, loss_fn, config or None).result()
    expected = 0.0
    for d, out in zip(data, result.loss_fn_outputs):
        logp = out["logprobs"].to_numpy().astype(np.float64)
        old, adv = (d.loss_fn_inputs[k].to_numpy().astype(np.float64) for k in ("logprobs", "advantages"))
        expected += expected_policy_loss(loss_fn, logp, old, adv, config)
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_custom_loss_trains_as_the_same_built_in_loss(service_client, server):
    """``forward_backward_custom`` (the SDK's forward, the user's loss, a weighted backward) with
    the cross-entropy written by hand moves the weights exactly as ``cross_entropy`` does."""
    data = mixed_datums()
    built_in = service_client.create_lora_training_client(base_model=MODEL, rank=0).result()
    custom = service_client.create_lora_training_client(base_model=MODEL, rank=0).result()

    def nll(batch, logprobs):
        loss = -sum((lp * torch.tensor(d.loss_fn_inputs["weights"].tolist())).sum() for d, lp in zip(batch, logprobs))
        return loss, {"nll": loss.item()}

    built = built_in.forward_backward(data, "cross_entropy").result()
    mine = custom.forward_backward_custom(data, nll).result()
    assert mine.metrics["nll"] == pytest.approx(built.metrics["loss:sum"], rel=1e-5)
    adam = types.AdamParams(learning_rate=1e-2)
    built_in.optim_step(adam).result()
    custom.optim_step(adam).result()
    a = sampler_weights(server, built_in.save_weights_for_sampler("built-in").result().path)
    b = sampler_weights(server, custom.save_weights_for_sampler("custom").result().path)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


def train_steps(client, data, steps: int, lr: float) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = client.forward_backward(data, "cross_entropy")  # both sent before either is read: the server keeps their order
        op = client.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        op.result()
    return losses


def test_lora_and_full_fine_tuning_clients_train_at_once(service_client, server):
    """Two training clients of one server, driven from two threads at once (their requests
    interleave): each keeps its own weights and optimizer, and each one's loss falls."""
    lora = service_client.create_lora_training_client(base_model=UNTIED, rank=8).result()  # attention, MLP and unembedding
    full = service_client.create_lora_training_client(base_model=MODEL, rank=0).result()
    info = lora.get_info()
    assert (info.is_lora, info.lora_rank, full.get_info().is_lora) == (True, 8, False)
    data = [datum([20, 21, 22, 23], [21, 22, 23, 24], weights=[1.0] * 4)]
    losses: dict[str, list[float]] = {}
    runs = (("lora", lora, 1e-2), ("full", full, 2e-2))
    threads = [threading.Thread(target=lambda c=c, k=k, lr=lr: losses.__setitem__(k, train_steps(c, data, 6, lr))) for k, c, lr in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, curve in losses.items():
        assert curve[-1] < 0.7 * curve[0], (name, curve)
    assert losses["lora"] != losses["full"]
