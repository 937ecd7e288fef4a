"""The training service's overhead: the same work through ``trellis serve`` and the tinker SDK over
HTTP on loopback, and in process (the service's own model and sampler classes called directly, no
HTTP, no futures, no protobuf).

Training: steps of ``forward_backward`` (cross_entropy, ``--datums`` datums of ``--tokens`` tokens)
then ``optim_step``; through the SDK both are sent before either is read, as tinker-cookbook's loops
do. Sampling: ``--samples`` samples of up to ``--new-tokens`` tokens from a 16-token prompt (one
request, the same seed both ways), tokens per second, the median of 5 requests. A random tiny Qwen2
(hidden 64, 2 layers) built locally, full fine-tuning, one thread for the server's work. Prints a table and a ``RESULT`` line.

    python bench/service.py [--steps 20] [--datums 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # conftest: the tests' tiny-model texts; served: trellis serve as a subprocess


def tiny_model(folder: Path) -> Path:
    from conftest import TEXTS

    from trellis_demo.tiny import make_tiny_model

    return make_tiny_model(folder, TEXTS, hidden_size=64, num_layers=2, seed=0)


def batch(rng, datums: int, tokens: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for _ in range(datums):
        ids = rng.integers(3, 250, tokens + 1).tolist()
        out.append((ids[:-1], ids[1:]))
    return out


def tokens_per_second(sample, reps: int = 5) -> float:
    """Sampled tokens per second of ``sample()`` (a SampleResponse), the median of ``reps`` calls."""
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        got = sample()
        rates.append(sum(len(s.tokens) for s in got.sequences) / (time.perf_counter() - start))
    return float(np.median(rates))


def in_process(folder: Path, data, steps: int, samples: int, new_tokens: int) -> tuple[float, float]:
    """(training steps/s, sampled tokens/s) calling the service's classes directly."""
    from tinker import types
    from tinker.proto.response_conv import deserialize_sample_response
    from trellis_service.sampling import Sampler
    from trellis_service.training import ModelShape, TrainedModel
    from trellis_service.wire import FwdBwdRequest, WireDatum

    from trellis import load_plugins

    registry = load_plugins().registry
    model = TrainedModel("bench:train:0", ModelShape("tiny"), folder, registry, "fsdp")
    wire = [WireDatum(t, {"target_tokens": np.asarray(y), "weights": np.ones(len(y), dtype=np.float32)}) for t, y in data]
    request = FwdBwdRequest("bench:train:0", 1, "cross_entropy", {}, False, wire)
    adam = types.AdamParams(learning_rate=1e-4)
    model.forward_backward(request)  # warm-up
    model.optim_step(adam)
    start = time.perf_counter()
    for _ in range(steps):
        model.forward_backward(request)
        model.optim_step(adam)
    train = steps / (time.perf_counter() - start)
    sampler = Sampler(folder, registry, "hf", "fsdp")
    ask = types.SampleRequest(
        prompt=types.ModelInput.from_ints(list(range(3, 19))),
        num_samples=samples,
        sampling_params=types.SamplingParams(max_tokens=new_tokens, seed=0, stop=[0]),
    )
    sampler.sample(ask)
    return train, tokens_per_second(lambda: deserialize_sample_response(sampler.sample(ask)))


def through_service(folder: Path, data, steps: int, samples: int, new_tokens: int) -> tuple[float, float]:
    """(training steps/s, sampled tokens/s) through ``trellis serve`` and the tinker SDK."""
    import tinker
    from served import TOKEN, start_server, stop_server
    from tinker import types

    server = start_server({"tiny": str(folder)}, Path(tempfile.mkdtemp()) / "root")
    try:
        client = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
        trainer = client.create_lora_training_client(base_model="tiny", rank=0).result()
        datums = [
            types.Datum(model_input=types.ModelInput.from_ints(t), loss_fn_inputs={"target_tokens": y, "weights": [1.0] * len(y)}) for t, y in data
        ]
        adam = types.AdamParams(learning_rate=1e-4)

        def step():
            fb, op = trainer.forward_backward(datums, "cross_entropy"), trainer.optim_step(adam)
            fb.result(), op.result()

        step()  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            step()
        train = steps / (time.perf_counter() - start)
        sampler = client.create_sampling_client(base_model="tiny").result()
        params = types.SamplingParams(max_tokens=new_tokens, seed=0, stop=[0])
        prompt = types.ModelInput.from_ints(list(range(3, 19)))
        sampler.sample(prompt, samples, params).result()
        sampled = tokens_per_second(lambda: sampler.sample(prompt, samples, params).result())
        client.close("success").result()
        return train, sampled
    finally:
        stop_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--datums", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    folder = tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    data = batch(np.random.default_rng(0), args.datums, args.tokens)
    local = in_process(folder, data, args.steps, args.samples, args.new_tokens)
    served = through_service(folder, data, args.steps, args.samples, args.new_tokens)
    work = f"{args.datums} datums x {args.tokens} tokens; {args.samples} x {args.new_tokens} sampled"
    print(f"| work ({work}) | in process | trellis serve + SDK | service / in process |")
    print("| --- | --- | --- | --- |")
    print(f"| forward_backward + optim_step, steps/s | {local[0]:.2f} | {served[0]:.2f} | {served[0] / local[0]:.3f} |")
    print(f"| sample, tokens/s | {local[1]:.1f} | {served[1]:.1f} | {served[1] / local[1]:.3f} |")
    print(
        f"RESULT train_steps_per_s_inproc={local[0]:.3f} train_steps_per_s_service={served[0]:.3f} train_ratio={served[0] / local[0]:.3f} "
        f"sample_tokens_per_s_inproc={local[1]:.1f} sample_tokens_per_s_service={served[1]:.1f} sample_ratio={served[1] / local[1]:.3f}"
    )


if __name__ == "__main__":
    main()
