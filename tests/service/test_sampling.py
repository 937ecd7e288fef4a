"""Sampling clients through the real tinker SDK: sampled tokens' log-probs equal a forward of the
saved sampler weights, seeds repeat, stop tokens and strings end samples, prompt log-probs and
top-k equal the model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from served import MODEL

tinker = pytest.importorskip("tinker")
types = tinker.types
PROMPT = [5, 9, 14, 3]


def folder_of(server, path: str):
    run, _, name = path.removeprefix("tinker://").split("/")
    return server.root / run.replace(":", "__") / "sampler_weights" / name


def hf_logprobs(folder, tokens: list[int]) -> np.ndarray:
    """log p(tokens[j] | tokens[:j]) for j >= 1, by a plain Hugging Face forward of ``folder``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()


@pytest.fixture(scope="module")
def trained_sampler(server):
    """A full fine-tuning client trained one step, its weights saved for sampling: (sampling client, folder)."""
    client = tinker.ServiceClient(base_url=server.url, api_key=__import__("served").TOKEN)
    trainer = client.create_lora_training_client(base_model=MODEL, rank=0).result()
    data = [types.Datum(model_input=types.ModelInput.from_ints(PROMPT), loss_fn_inputs={"target_tokens": PROMPT[1:] + [7], "weights": [1.0] * 4})]
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = trainer.save_weights_for_sampler("sampler-1").result().path
    yield trainer.create_sampling_client(path).result(), folder_of(server, path)
    client.close("success").result()


def test_sampled_log_probs_equal_a_forward_of_the_saved_sampler_weights(trained_sampler):
    sampler, folder = trained_sampler
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 3, types.SamplingParams(max_tokens=8, seed=11)).result()
    assert len(result.sequences) == 3
    for seq in result.sequences:
        assert 1 <= len(seq.tokens) <= 8 and seq.stop_reason in ("stop", "length")
        expected = hf_logprobs(folder, PROMPT + seq.tokens)[-len(seq.tokens) :]
        np.testing.assert_allclose(seq.logprobs, expected, rtol=0, atol=1e-4)
    again = sampler.sample(types.ModelInput.from_ints(PROMPT), 3, types.SamplingParams(max_tokens=8, seed=11)).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]


def test_prompt_log_probs_and_top_k_equal_the_model(trained_sampler):
    sampler, folder = trained_sampler
    prompt = PROMPT + [20, 21]
    expected = hf_logprobs(folder, prompt)
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert logprobs[0] is None
    np.testing.assert_allclose(logprobs[1:], expected, rtol=0, atol=1e-4)
    result = sampler.sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=3
    ).result()
    last_two = sampler.compute_logprobs(types.ModelInput.from_ints(prompt), prompt_logprobs_last_n=2).result()
    assert last_two[:-2] == [None] * (len(prompt) - 2) and last_two[-2:] == pytest.approx(logprobs[-2:], abs=1e-6)
    top = result.topk_prompt_logprobs
    assert top[0] is None and len(top) == len(prompt)
    for position, row in enumerate(top[1:], start=1):
        values = [lp for _, lp in row]
        assert len(row) == 3 and values == sorted(values, reverse=True)
        assert values[0] >= logprobs[position] - 1e-5
        if prompt[position] in [t for t, _ in row]:
            assert dict(row)[prompt[position]] == pytest.approx(logprobs[position], abs=1e-4)


def test_stop_tokens_and_stop_strings_end_samples(trained_sampler):
    from transformers import AutoTokenizer

    sampler, folder = trained_sampler
    tokenizer = AutoTokenizer.from_pretrained(folder)  # SamplingClient.get_tokenizer loads the base model's name from the Hub
    greedy = types.SamplingParams(max_tokens=10, temperature=0.0)
    full = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences[0]
    assert full.stop_reason == "length" and len(full.tokens) == 10, "the test needs 10 greedy tokens without EOS"
    stop_id = full.tokens[3]
    cut = full.tokens[: full.tokens.index(stop_id) + 1]
    by_id = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=10, temperature=0.0, stop=[stop_id])).result()
    assert (by_id.sequences[0].tokens, by_id.sequences[0].stop_reason) == (cut, "stop")
    text = tokenizer.decode(full.tokens[4:6])
    with_string = types.SamplingParams(max_tokens=10, temperature=0.0, stop=[text])
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, with_string).result().sequences[0]
    end = next(e for e in range(1, 11) if text in tokenizer.decode(full.tokens[:e]))
    assert (seq.tokens, seq.stop_reason) == (full.tokens[:end], "stop")


def test_base_model_sampling_client(service_client, models):
    sampler = service_client.create_sampling_client(base_model=MODEL).result()
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=4, seed=1)).result().sequences[0]
    np.testing.assert_allclose(seq.logprobs, hf_logprobs(models[MODEL], PROMPT + seq.tokens)[-len(seq.tokens) :], rtol=0, atol=1e-4)


def test_unnamed_snapshots_keep_the_latest_four(service_client, server):
    """``save_weights_and_get_sampling_client()`` (an RL loop's per-step snapshot) keeps the latest four
    per training client on disk; a sampling client of an older one is told it was replaced."""
    trainer = service_client.create_lora_training_client(base_model=MODEL, rank=0).result()
    samplers = [trainer.save_weights_and_get_sampling_client().result() for _ in range(5)]
    one = types.SamplingParams(max_tokens=1, seed=0)
    assert len(samplers[-1].sample(types.ModelInput.from_ints(PROMPT), 1, one).result().sequences) == 1
    with pytest.raises(tinker.BadRequestError, match="newer snapshots of its model replaced"):
        samplers[0].sample(types.ModelInput.from_ints(PROMPT), 1, one).result()
    run = server.root / trainer.model_id.replace(":", "__") / "sampler_weights"
    assert len(list(run.iterdir())) == 4
