"""Agent episodes per second through the policy endpoint (an agent on the ``openai`` client over
HTTP on loopback) against trellis-multiturn's in-process ``tool_agent`` loop doing the same work on the same engine.

Every episode is one tool call and an answer: the model (the tiny model of
``trellis_demo.tiny``, first taught in a few seconds of SFT to answer every arithmetic
question of the demo's task with the same ``add`` call, then ``#### 46`` after the tool's result:
``trellis_demo.tool_call``)
calls the tool, the result goes back, and the model answers (each turn ``--tokens`` new tokens at most). Both loops decode
greedily from the same prompts, so they sample the same tokens: the script checks that every
trajectory is the same token for token, then times each (median of ``--repeats``). The ratio
(endpoint / in-process) is the cost of the HTTP round trips, JSON, the chat template rendering of
each request and the tool-call parsing.

    .venv/bin/python bench/agent.py [--threads 2] [--prompts 16] [--n 4] [--tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


async def agent(client, sample):
    """The endpoint's episode: ask with the tools, run the calls the reply makes, ask again."""
    messages = list(sample.messages)
    first = await client.chat.completions.create(model="policy", messages=messages, tools=sample.tools)
    message = first.choices[0].message
    if not message.tool_calls:
        return 0.0
    results = [{"role": "tool", "tool_call_id": c.id, "content": str(sum(json.loads(c.function.arguments).values()))} for c in message.tool_calls]
    second = await client.chat.completions.create(model="policy", messages=[*messages, message, *results], tools=sample.tools)
    return float(results[0]["content"] in (second.choices[0].message.content or ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--tokens", type=int, default=48, help="max new tokens per model turn (the tool call is 34)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per loop (the median is shown)")
    parser.add_argument("--sft-steps", type=int, default=80, help="steps teaching the tiny model the tool call")
    args = parser.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from trellis.interfaces.rollout import RolloutSpec
    from trellis_algos import PromptDataset
    from trellis_demo.tasks import make_arithmetic_split
    from trellis_demo.tool_call import ADD, make_tool_calling_model
    from trellis_hf.engine import make_engine

    work = Path(tempfile.mkdtemp(prefix="trellis-bench-agent-"))
    rows = make_arithmetic_split(args.prompts, 0)
    start = time.perf_counter()
    taught = make_tool_calling_model(work, rows, args.sft_steps)
    print(f"taught the tool call in {time.perf_counter() - start:.1f} s ({args.sft_steps} steps)")
    tokenizer = AutoTokenizer.from_pretrained(taught)
    prompts = PromptDataset(rows, tokenizer, 512, chat_template_kwargs={"tools": [ADD]}).as_batch()
    engine = make_engine(RolloutSpec(taught, None, tokenizer))

    runs = {name: rollout_fn(name, tokenizer, args) for name in ("inprocess", "endpoint")}
    outs = {name: fn(engine, prompts) for name, fn in runs.items()}  # warm-up, and the same-work check
    check_same_work(outs, tokenizer)
    result = {}
    for name, fn in runs.items():
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = fn(engine, prompts)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        episodes = len(out["num_turns"])
        result[name] = {"seconds": seconds, "eps": episodes / seconds, "tokens_s": int(out["response_mask"].sum()) / seconds}

    ratio = result["endpoint"]["eps"] / result["inprocess"]["eps"]
    print(f"\n{args.prompts} prompts x {args.n} episodes (1 tool call + an answer, <= {args.tokens} tokens a turn), "
          f"HF engine, {args.threads} threads, median of {args.repeats}")  # fmt: skip
    print(f"{'loop':<12}{'episodes/s':>12}{'tokens/s':>11}{'seconds':>10}")
    for name in ("inprocess", "endpoint"):
        r = result[name]
        print(f"{name:<12}{r['eps']:>12.1f}{r['tokens_s']:>11.1f}{r['seconds']:>10.3f}")
    print(f"endpoint / in-process: {ratio:.3f}")
    print(f"RESULT endpoint_eps={result['endpoint']['eps']:.2f} inprocess_eps={result['inprocess']['eps']:.2f} ratio={ratio:.3f}")


def rollout_fn(name: str, tokenizer, args):
    """``fn(engine, prompts) -> Batch``: one rollout of every prompt's ``n`` episodes through ``name``'s loop."""
    from omegaconf import OmegaConf

    from trellis.config import validate
    from trellis.interfaces.agents import Tool, ToolResult
    from trellis.interfaces.rollout import SamplingParams
    from trellis.plugins import load_plugins
    from trellis_algos.rl.multi_turn import MultiTurnConfig
    from trellis_demo.tool_call import ADD
    from trellis_multiturn.environment import agent_spec
    from trellis_multiturn.rollout import agent_rollout

    class Add(Tool):
        schema = ADD

        async def execute(self, instance_id, arguments):
            return ToolResult(text=str(sum(arguments.values())))

    registry = load_plugins().registry
    if "bench_add" not in registry.names("tool"):
        registry.adding_for("bench")
        registry.add("tool", "bench_add", Add)
    section = {"enable": True, "max_assistant_turns": 2, "max_response_tokens": 4096, "max_concurrent_samples": args.prompts * args.n,
               "tools": [{"component": "bench_add"}]}  # fmt: skip
    if name == "endpoint":
        section |= {"agent_loop": "openai_agent", "agent": f"{Path(__file__).resolve()}:agent"}
    spec = agent_spec(validate(OmegaConf.create(section), MultiTurnConfig, registry, "multi_turn."), registry, tokenizer)
    rollout = agent_rollout(spec, registry)
    params = SamplingParams(n=args.n, max_new_tokens=args.tokens, greedy=True, seed=0)

    def run(engine, prompts):
        return asyncio.run(rollout(engine, prompts, params))

    return run


def check_same_work(outs: dict, tokenizer) -> None:
    """Both loops called the tool once per episode and sampled the same tokens."""
    inprocess, endpoint = outs["inprocess"], outs["endpoint"]
    played = inprocess["tool_calls"].tolist() == [1] * len(inprocess["tool_calls"]) and set(inprocess["finish_reason"]) == {"stop"}
    if not played:
        raise SystemExit(f"the taught model did not call the tool once, then answer ({inprocess['tool_calls'].tolist()}); raise --sft-steps")
    for key in ("responses", "response_mask"):
        if inprocess[key].shape != endpoint[key].shape or not (inprocess[key] == endpoint[key]).all():
            first = tokenizer.decode(inprocess["responses"][0]), tokenizer.decode(endpoint["responses"][0])
            raise SystemExit(f"the endpoint's trajectories differ from the in-process loop's ({key}); first episode:\n{first[0]!r}\n{first[1]!r}")
    if list(endpoint["finish_reason"]) != ["done"] * len(endpoint["finish_reason"]):
        raise SystemExit(f"endpoint episodes did not finish: {sorted(set(endpoint['finish_reason']))}")


if __name__ == "__main__":
    main()
