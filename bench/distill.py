"""On-policy distillation vs GRPO vs SFT on teacher samples, from a weak student to the demo's
RL-trained teacher: held-out greedy accuracy against steps and against training wall time, per seed.

Teacher: the demo's SFT model (``--sft-steps``) then the demo's RL stage (``demo_rl.yaml``), built
once per ``--out`` folder. Student: the same initial tiny model (same tokenizer) after only
``--student-sft-steps`` of the demo's SFT. From the student, per seed:

- distill: the ``trellis config init distill`` preset (``starter_distill.yaml``: advantage
  ``reverse_kl_teacher`` alone, its 4 samples a prompt, one update per batch) with
  ``teacher.path`` = the teacher and the demo's data, lengths, prompts per step and learning rate;
- GRPO: the demo's RL stage (16 prompts x 8 samples, rewarded by the task);
- SFT: the demo's SFT stage (``demo_sft.yaml``) on the teacher's greedy answers to the RL prompts
  (a parquet in the demo's schema, ``extra_info.answer`` replaced); a checkpoint every
  ``--sft-eval-every`` steps is exported and scored by ``trellis eval`` (the SFT recipe validates
  held-out loss only). Its clock starts at the seconds the teacher's answers took to generate.

Each arm runs a fixed number of steps (``--distill-steps``, ``--grpo-steps``, ``--sft-arm-steps``);
training seconds are summed from ``timing/step_s`` less ``timing/val_s`` in ``metrics.jsonl`` and
the table compares the arms at T, the shortest run's training time (each run's last validation
made by T). Writes ``distill.png``, ``distill_metrics.png``, ``summary.json``; ends with ``RESULT``.

    .venv/bin/python bench/distill.py [--seeds 0 1 2] [--distill-steps 200] [--grpo-steps 150] [--sft-arm-steps 200]
        [--val-every 10] [--sft-eval-every 20] [--student-sft-steps 300] [--threads 1] [--out runs/bench-distill]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

# What distillation takes from the demo's RL stage; the preset keeps its samples per prompt.
DEMO_KEYS = ("data.max_prompt_length", "data.train_batch_prompts", "sampling.temperature", "sampling.max_new_tokens",
             "validation.n", "validation.temperature", "actor.optim.lr", "actor.optim.grad_clip", "actor.micro_batch_samples")  # fmt: skip


def demo_teacher(out: Path, start: Path, rl_data: Path, test_data: Path, threads: int) -> Path:
    """The demo's RL stage from ``start``, run once per ``out`` folder: ``out/teacher/hf_model``."""
    from trellis.examples.demo import config_path
    from trellis.recipes.train import train

    teacher = out / "teacher" / "hf_model"
    if not teacher.is_dir():
        train(config_path("demo_rl.yaml"), [
            f"model.path={start}", f"data.train_path={rl_data}", f"data.val_path={test_data}", f"trainer.threads={threads}",
            "trainer.save_hf_model=true", "trainer.trackers=[jsonl]", f"trainer.run_dir={teacher.parent}",
        ])  # fmt: skip
    return teacher


def teacher_answers(teacher: Path, rl_data: Path, path: Path, max_new_tokens: int) -> tuple[Path, float, float]:
    """The teacher's greedy answer to every RL prompt as ``extra_info.answer`` of a copy of its row,
    written to ``path``; returns ``(path, seconds, share of right answers)``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trellis.data import encode_text, left_pad, load_rows, render_chat
    from trellis.examples.tasks import write_rows
    from trellis.rewards import gsm8k_score

    begin = time.perf_counter()
    rows = load_rows(rl_data)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    model = AutoModelForCausalLM.from_pretrained(teacher).eval()
    answers: list[str] = []
    for i in range(0, len(rows), 250):
        prompts = [encode_text(tokenizer, render_chat(tokenizer, r["prompt"], True, {})) for r in rows[i : i + 250]]
        ids, mask, _ = left_pad(prompts, tokenizer.pad_token_id)
        with torch.no_grad():
            generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        answers += tokenizer.batch_decode(generated[:, ids.shape[1] :], skip_special_tokens=True)
    seconds = time.perf_counter() - begin
    out = [{**r, "extra_info": {**r["extra_info"], "answer": a.strip()}} for r, a in zip(rows, answers)]
    right = statistics.mean(gsm8k_score(r["data_source"], a, r["reward_model"]["ground_truth"]) for r, a in zip(rows, answers))
    return write_rows(out, path), seconds, right


def held_out(model: Path, rl_data: Path, test_data: Path, seed: int, threads: int) -> tuple[float, float]:
    """``trellis eval`` of ``model`` with the demo's RL settings: held-out (greedy accuracy, sampled reward)."""
    from trellis.examples.demo import config_path
    from trellis.recipes.train import evaluate

    overrides = [f"model.path={model}", f"data.train_path={rl_data}", f"data.val_path={test_data}", f"seed={seed}", f"trainer.threads={threads}"]
    figures = evaluate(config_path("demo_rl.yaml"), overrides)
    return figures["greedy_reward_mean"], figures["reward_mean"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--distill-steps", type=int, default=200)
    parser.add_argument("--grpo-steps", type=int, default=150)
    parser.add_argument("--sft-arm-steps", type=int, default=200)
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--sft-eval-every", type=int, default=20, help="SFT arm: steps between checkpoints scored (each export + eval ~6 s)")
    parser.add_argument("--sft-steps", type=int, default=2000, help="the teacher's SFT stage")
    parser.add_argument("--student-sft-steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/bench-distill")
    args = parser.parse_args()

    from curves import SAMPLED, at_time, mean_std, plot_curves, train_seconds, val_curve
    from demo_start import demo_settings, demo_start

    from trellis.examples.demo import config_path
    from trellis.export import export_checkpoint
    from trellis.plot import plot_metrics, read_metrics
    from trellis.recipes.train import train

    out = Path(args.out)
    start, rl_data, test_data = demo_start(out, args.sft_steps, args.threads)
    teacher = demo_teacher(out, start, rl_data, test_data, args.threads)
    student, _, _ = demo_start(out, args.student_sft_steps, args.threads, stage="student")
    samples, gen_s, samples_right = teacher_answers(teacher, rl_data, out / "data" / "teacher_answers.parquet", 12)
    teacher_acc, teacher_sampled = held_out(teacher, rl_data, test_data, 0, args.threads)
    print(
        f"teacher: held-out greedy accuracy {teacher_acc:.3f}, sampled reward {teacher_sampled:.3f}; its greedy answers to the RL prompts: "
        f"{samples_right:.3f} right, generated in {gen_s:.1f} s"
    )

    paths = [f"model.path={student}", f"data.train_path={rl_data}", f"data.val_path={test_data}", f"trainer.threads={args.threads}",
             "trainer.trackers=[jsonl]"]  # fmt: skip
    arms = {
        "distill": (config_path("starter_distill.yaml"), [*demo_settings(DEMO_KEYS), f"teacher.path={teacher}"], args.distill_steps),
        "GRPO": (config_path("demo_rl.yaml"), [], args.grpo_steps),
    }
    runs: dict[str, list[Path]] = {m: [] for m in [*arms, "SFT"]}
    curves: dict[str, list[list[tuple[int, float, float]]]] = {m: [] for m in runs}  # greedy accuracy
    sampled: dict[str, list[list[tuple[int, float, float]]]] = {m: [] for m in runs}
    for arm, (config, settings, steps) in arms.items():
        for seed in args.seeds:
            run_dir = out / f"{arm.lower()}-seed{seed}"
            train(config, [*settings, *paths, f"seed={seed}", f"trainer.total_steps={steps}", f"trainer.val_every_steps={args.val_every}",
                           f"trainer.run_dir={run_dir}"])  # fmt: skip
            runs[arm].append(run_dir)
            curves[arm].append(val_curve(run_dir))
            sampled[arm].append(val_curve(run_dir, SAMPLED))
    for seed in args.seeds:
        run_dir = out / f"sft-seed{seed}"
        train(config_path("demo_sft.yaml"), [
            f"model.path={student}", f"data.train_path={samples}", f"data.val_path={test_data}", f"seed={seed}",
            f"trainer.total_steps={args.sft_arm_steps}", "trainer.val_every_steps=0", f"trainer.save_every_steps={args.sft_eval_every}",
            "trainer.keep_checkpoints=1000", f"trainer.threads={args.threads}", "trainer.trackers=[jsonl]", f"trainer.run_dir={run_dir}",
        ])  # fmt: skip
        seconds = train_seconds(run_dir, offset_s=gen_s)
        points = [(0, held_out(student, rl_data, test_data, seed, args.threads))]
        for step in range(args.sft_eval_every, args.sft_arm_steps + 1, args.sft_eval_every):
            exported = export_checkpoint(run_dir / f"checkpoint-{step}", out / "sft-exports" / f"seed{seed}-step{step}")
            points.append((step, held_out(exported, rl_data, test_data, seed, args.threads)))
        runs["SFT"].append(run_dir)
        curves["SFT"].append([(step, seconds[step], greedy) for step, (greedy, _) in points])
        sampled["SFT"].append([(step, seconds[step], value) for step, (_, value) in points])
    plot_curves(curves, out / "distill.png", "held-out greedy accuracy")
    plot_metrics([d for arm in arms for d in runs[arm]], out / "distill_metrics.png", ["reward/mean", "actor/entropy", "teacher/reverse_kl"])

    t_equal = min(c[-1][1] for cs in curves.values() for c in cs)
    print(f"\nheld-out greedy accuracy (200 prompts), mean ± std over seeds {args.seeds}; teacher {teacher_acc:.3f}")
    print(f"{'step':<6}" + "".join(f"{m + ' accuracy':>21}{'train s':>9}" for m in curves))
    for step in sorted({s for cs in curves.values() for c in cs for s, _, _ in c}):
        cells = ""
        for cs in curves.values():
            points = [p for c in cs for p in c if p[0] == step]
            cells += f"{mean_std([p[2] for p in points]):>21}{statistics.mean(p[1] for p in points):>9.0f}" if points else " " * 30
        print(f"{step:<6}{cells}")
    steps = {"distill": args.distill_steps, "GRPO": args.grpo_steps, "SFT": args.sft_arm_steps}
    figures = {m: {"start": statistics.mean(c[0][2] for c in cs), "final": statistics.mean(c[-1][2] for c in cs),
                   "at_equal_time": statistics.mean(at_time(c, t_equal) for c in cs),
                   "train_s_per_step": statistics.mean(c[-1][1] - c[0][1] for c in cs) / steps[m]}
               for m, cs in curves.items()}  # fmt: skip
    for m, cs in curves.items():
        figures[m] |= {"sampled_final": statistics.mean(c[-1][2] for c in sampled[m]),
                       "sampled_at_equal_time": statistics.mean(at_time(c, t_equal) for c in sampled[m])}  # fmt: skip
        print(f"{m}: {figures[m]['train_s_per_step']:.2f} training s/step; at {t_equal:.0f} s greedy {mean_std([at_time(c, t_equal) for c in cs])}, "
              f"sampled {mean_std([at_time(c, t_equal) for c in sampled[m]])} (start {statistics.mean(c[0][2] for c in sampled[m]):.3f}, last step "
              f"{mean_std([c[-1][2] for c in sampled[m]])})")  # fmt: skip
    kl = [[r["teacher/reverse_kl"] for r in read_metrics(d) if "teacher/reverse_kl" in r] for d in runs["distill"]]
    figures["distill"] |= {"reverse_kl_first10": statistics.mean(k for ks in kl for k in ks[:10]),
                           "reverse_kl_last10": statistics.mean(k for ks in kl for k in ks[-10:])}  # fmt: skip
    print(
        f"distill: teacher/reverse_kl {figures['distill']['reverse_kl_first10']:.3f} (first 10 steps) -> "
        f"{figures['distill']['reverse_kl_last10']:.3f} (last 10)"
    )
    summary = {"teacher_greedy": teacher_acc, "teacher_sampled": teacher_sampled, "teacher_answers_right": samples_right,
               "teacher_answers_s": gen_s, "equal_time_s": t_equal, "figures": figures, "greedy": curves, "sampled": sampled}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    fields = " ".join(f"{m.lower()}_{k}={v:.3f}" for m in figures for k, v in figures[m].items())
    print(
        f"RESULT teacher={teacher_acc:.3f} {fields} equal_time_s={t_equal:.0f} seeds={len(args.seeds)} "
        f"steps={args.distill_steps}/{args.grpo_steps}/{args.sft_arm_steps}"
    )


if __name__ == "__main__":
    main()
