"""The demo: a tiny model learns arithmetic from scratch on a CPU, SFT warm start then GRPO.

Stages: task data (train / held-out) -> tiny model -> ``sft`` recipe -> ``rl`` recipe. Prints a
before/after table of held-out reward, writes ``summary.json`` (with the versions, CPU and thread
counts the figures were made with) and ``curves.png`` in the run folder.
With ``--multiturn`` the RL stage is a conversation: a wrong answer gets "Wrong, try again." from
the ``gsm8k`` interaction (trellis-interactions, run by trellis-multiturn) and a second try; the table shows the reward of
the first answer alone (no feedback) and after feedback. Its SFT data shows the format: each row
taught a wrong answer goes on with the feedback and the right answer.
With ``--vision`` a tiny vision-language model (Qwen2-VL) learns to count the squares of generated
images (``trellis_demo.shapes``; needs trellis-vision), with the same stages and table.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from trellis import train
from trellis.kit.runs import plot_metrics, read_provenance
from trellis_demo.shapes import make_shapes_split, shape_texts
from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
from trellis_demo.tiny import make_tiny_model

log = logging.getLogger("trellis")

TASK = {"ops": ("+",), "min_value": 0, "max_value": 99}
SFT_ROWS, RL_ROWS, VAL_ROWS = 6000, 2000, 200
NOISY_ANSWER = 0.25  # share of SFT answers taught wrong: the SFT model samples a mixture RL can sharpen
# (at 0.5 the right answer was too weak a signal for 2000 SFT steps: greedy accuracy 0.31-0.43 over
# seeds 0-1 and RL gains of +0.09-0.12; at 0.25, 0.48-0.96 and +0.18-0.26 over seeds 0-2, one thread)
FEEDBACK = "Wrong, try again."
FEEDBACK_NOISY_ANSWER = 0.5  # with --multiturn: each wrong SFT answer also teaches the second try after feedback
MULTI_TURN = [  # a wrong first answer is told so and may try once more
    "multi_turn.enable=true",
    "multi_turn.max_assistant_turns=2",
    "multi_turn.max_user_turns=1",
    "multi_turn.max_response_tokens=48",
    f"multi_turn.interactions=[{{name: gsm8k, component: gsm8k, options: {{feedback: '{FEEDBACK}'}}}}]",
]
MULTI_TURN_SFT = ["data.max_length=64"]  # room for the corrected conversations
CURVES = ("reward/mean", "val/reward_mean", "actor/entropy", "response/length_mean")
MULTI_TURN_CURVES = ("reward/mean", "reward/first_turn_mean", "val/reward_mean", "val/first_turn_reward_mean", "multiturn/num_turns_mean")
# an image prompt is 6 image tokens plus the chat template's; the tiny model counts the squares within a few hundred steps
VISION_SFT = ["data.max_length=48", "trainer.total_steps=500", "trainer.val_every_steps=250"]
VISION_RL = ["data.max_prompt_length=48", "trainer.total_steps=100"]


def config_path(name: str) -> str:
    return str(resources.files("trellis_demo") / "configs" / name)


@dataclass(frozen=True)
class DemoTask:
    """What a demo variant trains on: its rows by seed (``sft_train``, ``rl_train``, ``test``), the
    tokenizer's text, the tiny model's sizes, each stage's overrides, the curves and the table."""

    rows: Callable[[int], dict[str, list[dict]]]
    texts: Callable[[int], list[str]]
    model: dict
    sft: tuple[str, ...] = ()
    rl: tuple[str, ...] = ()
    curves: tuple[str, ...] = CURVES
    table: Callable[[dict], str] = lambda result: format_table(result)


def _arithmetic_rows(seed: int, multiturn: bool = False) -> dict[str, list[dict]]:
    sft = make_arithmetic_split(SFT_ROWS, seed, noisy_answer=FEEDBACK_NOISY_ANSWER if multiturn else NOISY_ANSWER, **TASK)
    interaction = "gsm8k" if multiturn else None
    return {
        "sft_train": feedback_conversations(sft) if multiturn else sft,
        "rl_train": make_arithmetic_split(RL_ROWS, seed + 1, interaction=interaction, **TASK),
        "test": make_arithmetic_split(VAL_ROWS, seed, split="test", interaction=interaction, **TASK),
    }


def _shapes_rows(seed: int) -> dict[str, list[dict]]:
    return {
        "sft_train": make_shapes_split(SFT_ROWS, seed, noisy_answer=NOISY_ANSWER),
        "rl_train": make_shapes_split(RL_ROWS, seed + 1),
        "test": make_shapes_split(VAL_ROWS, seed, split="test"),
    }


MODEL = {"hidden_size": 128, "num_layers": 4, "num_heads": 4}
TASKS = {
    "arithmetic": DemoTask(_arithmetic_rows, lambda seed: task_texts(seed=seed, ops=TASK["ops"]), MODEL),
    "multiturn": DemoTask(
        lambda seed: _arithmetic_rows(seed, multiturn=True),
        lambda seed: [*task_texts(seed=seed, ops=TASK["ops"]), FEEDBACK],
        MODEL,
        tuple(MULTI_TURN_SFT),
        tuple(MULTI_TURN),
        MULTI_TURN_CURVES,
        lambda result: format_multiturn_table(result),
    ),
    "vision": DemoTask(_shapes_rows, lambda seed: shape_texts(), {**MODEL, "vision": True}, tuple(VISION_SFT), tuple(VISION_RL)),
}


def run_demo(out: Path, sft_overrides: list[str] = (), rl_overrides: list[str] = (), seed: int = 0, task: str = "arithmetic") -> dict:
    demo = TASKS[task]
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    start = time.perf_counter()
    data = out / "data"
    for name, rows in demo.rows(seed).items():
        write_rows(rows, data / f"{name}.parquet")
    model = make_tiny_model(out / "model", demo.texts(seed), seed=seed, **demo.model)
    times["setup_s"] = time.perf_counter() - start

    start = time.perf_counter()
    sft_dir, rl_dir = out / "sft", out / "rl"
    for stage in (sft_dir, rl_dir):  # the demo always trains from scratch (a run folder would otherwise resume)
        shutil.rmtree(stage, ignore_errors=True)
    held_out = [f"data.val_path={data / 'test.parquet'}", f"seed={seed}"]
    sft = [f"model.path={model}", f"data.train_path={data / 'sft_train.parquet'}", f"trainer.run_dir={sft_dir}", *held_out, *demo.sft]
    train(config_path("demo_sft.yaml"), [*sft, *sft_overrides])
    times["sft_s"] = time.perf_counter() - start

    start = time.perf_counter()
    rl = [f"model.path={sft_dir / 'hf_model'}", f"data.train_path={data / 'rl_train.parquet'}", f"trainer.run_dir={rl_dir}", *held_out, *demo.rl]
    summary = train(config_path("demo_rl.yaml"), [*rl, *rl_overrides])
    times["rl_s"] = time.perf_counter() - start

    before, after = summary["val_before"], summary["val_after"]
    result = {
        "after_sft": _figures(before),
        "after_rl": _figures(after),
        "gain_sampled_reward": after["reward_mean"] - before["reward_mean"],
        "wall_time_s": {**times, "total_s": sum(times.values())},
        "held_out_prompts": VAL_ROWS,
        "seed": seed,
        "task": task,
        "multiturn": task == "multiturn",
        "provenance": stage_provenance(sft_dir, rl_dir),
    }
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    plot_metrics([rl_dir], out / "curves.png", list(demo.curves))
    print(demo.table(result))
    return result


def stage_provenance(sft_dir: Path, rl_dir: Path) -> dict:
    """What the figures also depend on (versions, CPU), from the stages' ``provenance.json``, with
    the torch thread count of each stage."""
    sft, rl = read_provenance(sft_dir), read_provenance(rl_dir)
    return {**rl, "torch_threads": {"sft": sft["torch_threads"], "rl": rl["torch_threads"]}}


def feedback_conversations(rows: list[dict]) -> list[dict]:
    """SFT rows as chat ``messages``: a row taught a wrong answer goes on with the feedback and the
    right answer, so the model has seen what a second try after "Wrong, try again." looks like."""
    out = []
    for row in rows:
        messages = [*row["prompt"], {"role": "assistant", "content": row["extra_info"]["answer"]}]
        if row["extra_info"]["noisy"]:
            right = f"#### {row['reward_model']['ground_truth']}"
            messages += [{"role": "user", "content": FEEDBACK}, {"role": "assistant", "content": right}]
        out.append({"messages": messages, "data_source": row["data_source"]})
    return out


def _figures(val: dict) -> dict:
    """Held-out figures: with multi-turn, "sampled_reward" / "greedy_accuracy" are after feedback
    and the ``first_answer_`` ones are the first answer alone."""
    out = {"sampled_reward": val["reward_mean"], "greedy_accuracy": val["greedy_reward_mean"]}
    if "first_turn_reward_mean" in val:
        out |= {"first_answer_sampled_reward": val["first_turn_reward_mean"], "first_answer_greedy_accuracy": val["greedy_first_turn_reward_mean"]}
    return out


def format_table(r: dict) -> str:
    t = r["wall_time_s"]
    lines = [
        f"held-out ({r['held_out_prompts']} prompts)   sampled reward   greedy accuracy",
        f"after SFT                 {r['after_sft']['sampled_reward']:>14.3f}   {r['after_sft']['greedy_accuracy']:>15.3f}",
        f"after RL (GRPO)           {r['after_rl']['sampled_reward']:>14.3f}   {r['after_rl']['greedy_accuracy']:>15.3f}",
        f"gain                      {r['gain_sampled_reward']:>+14.3f}",
        f"wall time: setup {t['setup_s']:.0f} s, SFT {t['sft_s']:.0f} s, RL {t['rl_s']:.0f} s, total {t['total_s']:.0f} s",
    ]
    return "\n".join(lines)


def format_multiturn_table(r: dict) -> str:
    t = r["wall_time_s"]
    rows = [("after SFT", r["after_sft"]), ("after RL (multi-turn GRPO)", r["after_rl"])]
    lines = [
        f"held-out ({r['held_out_prompts']} prompts)      first answer (no feedback)    after feedback (2nd try)",
        "                                sampled      greedy          sampled      greedy",
        *(
            f"{name:<28}{f['first_answer_sampled_reward']:>11.3f} {f['first_answer_greedy_accuracy']:>11.3f}"
            f"      {f['sampled_reward']:>11.3f} {f['greedy_accuracy']:>11.3f}"
            for name, f in rows
        ),
        f"wall time: setup {t['setup_s']:.0f} s, SFT {t['sft_s']:.0f} s, RL {t['rl_s']:.0f} s, total {t['total_s']:.0f} s",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``trellis demo``'s flags."""
    parser.add_argument("--out", default="runs/demo", help="run folder (default runs/demo)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft", nargs="*", default=[], help="overrides for the SFT stage (key=value)")
    parser.add_argument("--rl", nargs="*", default=[], help="overrides for the RL stage (key=value)")
    variant = parser.add_mutually_exclusive_group()
    variant.add_argument(
        "--multiturn",
        action="store_true",
        help="RL with feedback: a wrong answer is told so and tries again (needs trellis-multiturn and trellis-interactions)",
    )
    variant.add_argument("--vision", action="store_true", help="a tiny vision-language model counts squares in images (needs trellis-vision)")


def cmd_demo(args: argparse.Namespace) -> int:
    run_demo(Path(args.out), args.sft, args.rl, args.seed, "multiturn" if args.multiturn else "vision" if args.vision else "arithmetic")
    return 0
