"""On-policy distillation's losses vs TRL's GKDTrainer vs GRPO vs SFT on teacher samples, from a
weak student to the demo's RL-trained teacher: held-out greedy accuracy against steps and training
wall time per seed, and the student's exact reverse KL to the teacher on held-out samples.

Teacher: the demo's SFT model (``--sft-steps``) then the demo's RL stage (``demo_rl.yaml``), built
once per ``--out`` folder. Student: the same initial tiny model (same tokenizer) after only
``--student-sft-steps`` of the demo's SFT. From the student, per seed, the arms ``--arms`` names:

- distill: the ``trellis config init distill`` preset as shipped (``starter_distill.yaml``: the
  actor's loss ``actor.distill``, the generalised JSD (beta 0.5) over the teacher's top 128 tokens,
  no policy loss, 64 prompts x 1 sample a step) with ``teacher.path`` = the teacher and the demo's
  data, lengths and learning rate; ``jsd-exact``: the same over the whole vocabulary
  (``top_k=0``); ``reverse-kl``, ``reverse-kl-exact``, ``reverse-kl-16``: the reverse KL (TRL
  GKD's ``beta=1``) over the top 128, the whole vocabulary, the top 16; ``sampled``: the
  sampled-token advantage ``reverse_kl_teacher`` alone (the preset before the loss existed: each
  token credited with its own ``log q - log p``);
- TRL: TRL 1.16's ``GKDTrainer`` with ``lmbda=1`` (on-policy) and ``beta=1`` (reverse KL), the same
  samples a step (64 prompts, one completion each), lengths, temperature and learning rate, in its
  own venv (``--trl-venv``, made on first use as ``bench/compare_trl.py`` makes it); a checkpoint
  every ``--trl-eval-every`` steps scored by ``trellis eval``; seconds a step from its own clock;
- GRPO: the demo's RL stage (16 prompts x 8 samples, rewarded by the task);
- SFT: the demo's SFT stage (``demo_sft.yaml``) on the teacher's greedy answers to the RL prompts
  (a parquet in the demo's schema, ``extra_info.answer`` replaced); a checkpoint every
  ``--sft-eval-every`` steps is exported and scored by ``trellis eval`` (the SFT recipe validates
  held-out loss only). Its clock starts at the seconds the teacher's answers took to generate.

One evaluator for all: held-out greedy accuracy by ``trellis eval``'s settings, and the exact
KL(student || teacher) over the whole vocabulary averaged over the tokens the student samples
(temperature 1) for the first 100 held-out prompts, at the start and for each arm's final model.
Training seconds are summed from ``timing/step_s`` less ``timing/val_s`` in ``metrics.jsonl`` and
the table compares the arms at T, the shortest run's training time (each run's last validation
made by T). Writes ``distill.png``, ``distill_metrics.png``, ``summary.json``; ends with ``RESULT``.

    .venv/bin/python bench/distill.py [--arms distill jsd-exact reverse-kl reverse-kl-exact reverse-kl-16 sampled TRL GRPO SFT] [--seeds 0 1 2]
        [--distill-steps 200] [--grpo-steps 150] [--sft-arm-steps 200] [--val-every 10] [--sft-eval-every 20]
        [--trl-eval-every 20] [--student-sft-steps 300] [--threads 1] [--out runs/bench-distill]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

# What distillation takes from the demo's RL stage; the preset keeps its prompts and samples per step (64 x 1).
DEMO_KEYS = ("data.max_prompt_length", "sampling.temperature", "sampling.max_new_tokens",
             "validation.n", "validation.temperature", "actor.optim.lr", "actor.optim.grad_clip", "actor.micro_batch_samples")  # fmt: skip


def demo_teacher(out: Path, start: Path, rl_data: Path, test_data: Path, threads: int) -> Path:
    """The demo's RL stage from ``start``, run once per ``out`` folder: ``out/teacher/hf_model``."""
    from trellis.recipes.train import train
    from trellis_demo.demo import config_path

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
    from trellis_algos import gsm8k_score
    from trellis_demo.tasks import write_rows

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
    from trellis.recipes.train import evaluate
    from trellis_demo.demo import config_path

    overrides = [f"model.path={model}", f"data.train_path={rl_data}", f"data.val_path={test_data}", f"seed={seed}", f"trainer.threads={threads}"]
    figures = evaluate(config_path("demo_rl.yaml"), overrides)
    return figures["greedy_reward_mean"], figures["reward_mean"]


def held_out_reverse_kl(model: Path, teacher: Path, test_data: Path, max_new_tokens: int, prompts: int = 100) -> float:
    """KL(model || teacher) over the whole vocabulary at each token ``model`` samples (temperature
    1, seed 0) for the first ``prompts`` held-out prompts, up to and including its end token; the
    mean over those tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trellis.batch import position_ids
    from trellis.data import encode_text, left_pad, load_rows, render_chat

    tokenizer = AutoTokenizer.from_pretrained(model)
    student, scorer = (AutoModelForCausalLM.from_pretrained(p).eval() for p in (model, teacher))
    encoded = [encode_text(tokenizer, render_chat(tokenizer, r["prompt"], True, {})) for r in load_rows(test_data)[:prompts]]
    ids, mask, _ = left_pad(encoded, tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.no_grad():
        sequences = student.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                     max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        responses = sequences[:, ids.shape[1] :]
        ended = (responses == tokenizer.eos_token_id).int()
        valid = (ended.cumsum(-1) - ended) == 0  # every token up to and including the first end token
        attention = torch.cat([mask, valid.long()], 1)
        inputs = {"input_ids": sequences, "attention_mask": attention, "position_ids": position_ids(attention)}
        p, q = (m(**inputs).logits[:, ids.shape[1] - 1 : -1].float().log_softmax(-1) for m in (student, scorer))
    kl = (p.exp() * (p - q)).sum(-1)
    return float(kl[valid].mean())


def trl_gkd(args: argparse.Namespace) -> None:
    """Inside the TRL venv: one GKDTrainer run (``lmbda=1``, ``beta=1``) from ``--trl-student`` to
    ``--trl-teacher`` on the RL prompts, a checkpoint every ``--trl-eval-every`` steps in
    ``--trl-out``, and ``trl.json`` there with its seconds a step (its own clock, generation included)."""
    import os
    import time

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    torch.set_num_threads(args.threads)
    rows = pq.read_table(args.trl_data).to_pylist()
    # the assistant turn is a placeholder: with lmbda=1 every completion is the student's own
    dataset = Dataset.from_list([{"messages": [*r["prompt"], {"role": "assistant", "content": "0"}]} for r in rows])
    config = GKDConfig(
        output_dir=args.trl_out, per_device_train_batch_size=TRL_SAMPLES, max_steps=args.distill_steps, learning_rate=args.trl_lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, lmbda=1.0, beta=1.0, temperature=1.0,
        max_new_tokens=args.trl_max_new_tokens, max_length=128, save_strategy="steps", save_steps=args.trl_eval_every, save_only_model=True,
        logging_steps=10, seed=args.trl_seed, report_to=[], use_cpu=True, bf16=False, dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=False,  # as Trellis: no recomputation (TRL's default recomputes every layer in the backward)
    )  # fmt: skip
    step_s: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.began = time.perf_counter()

        def on_step_end(self, *_, **__):
            step_s.append(time.perf_counter() - self.began)

    tokenizer = AutoTokenizer.from_pretrained(args.trl_student)
    trainer = GKDTrainer(model=AutoModelForCausalLM.from_pretrained(args.trl_student),
                         teacher_model=AutoModelForCausalLM.from_pretrained(args.trl_teacher), args=config, train_dataset=dataset,
                         processing_class=tokenizer, callbacks=[Clock()])  # fmt: skip
    trainer.train()
    Path(args.trl_out, "trl.json").write_text(json.dumps({"step_s": step_s, "log": trainer.state.log_history}))


# TRL's samples a step: the distillation arms' 64 prompts x 1 sample
TRL_SAMPLES = 64


def run_trl(args, student: Path, teacher: Path, rl_data: Path, test_data: Path, seed: int, run_dir: Path) -> list[tuple[int, float, float]]:
    """The TRL arm for one seed: ``(step, training seconds, held-out greedy accuracy)`` at the start
    and at each checkpoint, and its final model's folder in ``run_dir/final``."""
    import subprocess
    import sys

    from compare_trl import ensure_venv

    if not (run_dir / "trl.json").is_file():
        python = ensure_venv(args.trl_venv)
        subprocess.run([str(python), __file__, "--trl-inner", f"--trl-student={student}", f"--trl-teacher={teacher}",
                        f"--trl-data={rl_data}", f"--trl-out={run_dir}", f"--trl-seed={seed}", f"--trl-lr={args.trl_lr}",
                        f"--trl-max-new-tokens={args.trl_max_new_tokens}", f"--trl-eval-every={args.trl_eval_every}",
                        f"--distill-steps={args.distill_steps}", f"--threads={args.threads}"], check=True, stdout=sys.stderr)  # fmt: skip
    step_s = json.loads((run_dir / "trl.json").read_text())["step_s"]
    elapsed = [0.0, *itertools.accumulate(step_s)]
    points = [(0, 0.0, held_out(student, rl_data, test_data, seed, args.threads)[0])]
    for step in range(args.trl_eval_every, args.distill_steps + 1, args.trl_eval_every):
        points.append((step, elapsed[step], held_out(run_dir / f"checkpoint-{step}", rl_data, test_data, seed, args.threads)[0]))
    return points


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=[*DISTILL_ARMS, "TRL", "GRPO", "SFT"], choices=[*DISTILL_ARMS, "TRL", "GRPO", "SFT"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--distill-steps", type=int, default=200, help="every distillation arm's steps, TRL's included")
    parser.add_argument("--grpo-steps", type=int, default=150)
    parser.add_argument("--sft-arm-steps", type=int, default=200)
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--sft-eval-every", type=int, default=20, help="SFT arm: steps between checkpoints scored (each export + eval ~6 s)")
    parser.add_argument("--trl-eval-every", type=int, default=20, help="TRL arm: steps between checkpoints scored")
    parser.add_argument("--trl-venv", type=Path, default=Path(__file__).resolve().parent.parent / ".venv-bench-trl")
    parser.add_argument("--sft-steps", type=int, default=2000, help="the teacher's SFT stage")
    parser.add_argument("--student-sft-steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/bench-distill")
    # the TRL arm's inner run (re-invoked inside the TRL venv)
    parser.add_argument("--trl-inner", action="store_true", help=argparse.SUPPRESS)
    for name in ("student", "teacher", "data", "out"):
        parser.add_argument(f"--trl-{name}", help=argparse.SUPPRESS)
    parser.add_argument("--trl-seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--trl-lr", type=float, default=2e-4, help=argparse.SUPPRESS)
    parser.add_argument("--trl-max-new-tokens", type=int, default=12, help=argparse.SUPPRESS)
    return parser.parse_args()


# the distillation arms: (the divergence, overrides) of the distill preset (which ships the JSD, beta 0.5, over the top 128
# tokens, no policy loss); a divergence replaces the preset's actor.distill.loss section whole (its options differ)
REVERSE_KL = {"name": "reverse_kl"}
DISTILL_ARMS = {
    "distill": (None, []),
    "jsd-exact": (None, ["actor.distill.top_k=0"]),
    "reverse-kl": (REVERSE_KL, []),
    "reverse-kl-exact": (REVERSE_KL, ["actor.distill.top_k=0"]),
    "reverse-kl-16": (REVERSE_KL, ["actor.distill.top_k=16"]),
    "sampled": (REVERSE_KL, ["actor.distill.coef=0.0", "actor.distill.top_k=0", "actor.distill.use_policy_loss=true",
                             "algorithm.advantage.name=reverse_kl_teacher"]),
}  # fmt: skip


def arm_config(out: Path, arm: str, loss: dict | None) -> Path:
    """The distill preset, with ``loss`` as its ``actor.distill.loss`` section when given, in ``out``."""
    from omegaconf import OmegaConf

    from trellis.cli import STARTERS

    if loss is None:
        return str(STARTERS["distill"])
    preset = OmegaConf.load(str(STARTERS["distill"]))
    preset.actor.distill.loss = loss
    path = out / "configs" / f"{arm}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(preset, path)
    return path


def main() -> None:
    args = parse()
    if args.trl_inner:
        return trl_gkd(args)

    from curves import SAMPLED, at_time, mean_std, plot_curves, train_seconds, val_curve
    from demo_start import demo_settings, demo_start

    from trellis.export import export_checkpoint
    from trellis.plot import plot_metrics, read_metrics
    from trellis.recipes.train import train
    from trellis_demo.demo import config_path

    out = Path(args.out)
    start, rl_data, test_data = demo_start(out, args.sft_steps, args.threads)
    teacher = demo_teacher(out, start, rl_data, test_data, args.threads)
    student, _, _ = demo_start(out, args.student_sft_steps, args.threads, stage="student")
    teacher_acc, teacher_sampled = held_out(teacher, rl_data, test_data, 0, args.threads)
    max_new_tokens = int(demo_settings(("sampling.max_new_tokens",))[0].split("=")[1])
    kl_start = held_out_reverse_kl(student, teacher, test_data, max_new_tokens)
    print(f"teacher: held-out greedy accuracy {teacher_acc:.3f}, sampled reward {teacher_sampled:.3f}; student's reverse KL to it {kl_start:.3f}")

    paths = [f"model.path={student}", f"data.train_path={rl_data}", f"data.val_path={test_data}", f"trainer.threads={args.threads}",
             "trainer.trackers=[jsonl]", "trainer.save_hf_model=true"]  # fmt: skip
    arms = {arm: (arm_config(out, arm, loss), [*demo_settings(DEMO_KEYS), f"teacher.path={teacher}", *extra], args.distill_steps)
            for arm, (loss, extra) in DISTILL_ARMS.items()}  # fmt: skip
    arms["GRPO"] = (config_path("demo_rl.yaml"), [], args.grpo_steps)
    arms = {arm: v for arm, v in arms.items() if arm in args.arms}
    runs: dict[str, list[Path]] = {m: [] for m in args.arms}
    curves: dict[str, list[list[tuple[int, float, float]]]] = {m: [] for m in args.arms}  # greedy accuracy
    sampled: dict[str, list[list[tuple[int, float, float]]]] = {m: [] for m in arms}
    final_kl: dict[str, list[float]] = {m: [] for m in args.arms if m != "SFT"}
    for arm, (config, settings, steps) in arms.items():
        for seed in args.seeds:
            run_dir = out / f"{arm.lower()}-seed{seed}"
            if not (run_dir / "hf_model").is_dir():
                train(config, [*settings, *paths, f"seed={seed}", f"trainer.total_steps={steps}", f"trainer.val_every_steps={args.val_every}",
                               f"trainer.run_dir={run_dir}"])  # fmt: skip
            runs[arm].append(run_dir)
            curves[arm].append(val_curve(run_dir))
            sampled[arm].append(val_curve(run_dir, SAMPLED))
            final_kl[arm].append(held_out_reverse_kl(run_dir / "hf_model", teacher, test_data, max_new_tokens))
    if "TRL" in args.arms:
        for seed in args.seeds:
            run_dir = out / f"trl-seed{seed}"
            curves["TRL"].append(run_trl(args, student, teacher, rl_data, test_data, seed, run_dir))
            final_kl["TRL"].append(held_out_reverse_kl(run_dir / f"checkpoint-{args.distill_steps}", teacher, test_data, max_new_tokens))
    if "SFT" in args.arms:
        samples, gen_s, samples_right = teacher_answers(teacher, rl_data, out / "data" / "teacher_answers.parquet", max_new_tokens)
        print(f"teacher's greedy answers to the RL prompts: {samples_right:.3f} right, generated in {gen_s:.1f} s")
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
    plot_curves(curves, out / "distill.png", "held-out greedy accuracy")
    if arms:
        plot_metrics([d for arm in arms for d in runs[arm]], out / "distill_metrics.png", ["reward/mean", "teacher/reverse_kl", "actor/distill_loss"])

    t_equal = min(c[-1][1] for cs in curves.values() for c in cs)
    print(f"\nheld-out greedy accuracy (200 prompts), mean ± std over seeds {args.seeds}; teacher {teacher_acc:.3f}")
    print(f"{'step':<6}" + "".join(f"{m + ' accuracy':>21}{'train s':>9}" for m in curves))
    for step in sorted({s for cs in curves.values() for c in cs for s, _, _ in c}):
        cells = ""
        for cs in curves.values():
            points = [p for c in cs for p in c if p[0] == step]
            cells += f"{mean_std([p[2] for p in points]):>21}{statistics.mean(p[1] for p in points):>9.0f}" if points else " " * 30
        print(f"{step:<6}{cells}")
    steps = {"GRPO": args.grpo_steps, "SFT": args.sft_arm_steps}
    figures = {m: {"start": statistics.mean(c[0][2] for c in cs), "final": statistics.mean(c[-1][2] for c in cs),
                   "at_equal_time": statistics.mean(at_time(c, t_equal) for c in cs),
                   "train_s_per_step": statistics.mean(c[-1][1] - c[0][1] for c in cs) / steps.get(m, args.distill_steps)}
               for m, cs in curves.items()}  # fmt: skip
    print(f"\nexact reverse KL(student || teacher) on held-out samples: start {kl_start:.3f}")
    for m in curves:
        if m in final_kl:
            figures[m]["reverse_kl_final"] = statistics.mean(final_kl[m])
        greedy_at_t = mean_std([at_time(c, t_equal) for c in curves[m]])
        kl_text = f", reverse KL {mean_std(final_kl[m])}" if m in final_kl else ""
        print(f"{m}: {figures[m]['train_s_per_step']:.3f} training s/step; at {t_equal:.0f} s greedy {greedy_at_t}; "
              f"final greedy {mean_std([c[-1][2] for c in curves[m]])}{kl_text}")  # fmt: skip
    for m in sampled:
        kl = [[r["teacher/reverse_kl"] for r in read_metrics(d) if "teacher/reverse_kl" in r] for d in runs[m]]
        if any(kl):
            figures[m] |= {"logged_reverse_kl_first10": statistics.mean(k for ks in kl for k in ks[:10]),
                           "logged_reverse_kl_last10": statistics.mean(k for ks in kl for k in ks[-10:])}  # fmt: skip
    trl_s = figures["TRL"]["train_s_per_step"] if "TRL" in figures else None
    ratios = {f"{m}_over_trl_s_per_step": figures[m]["train_s_per_step"] / trl_s for m in curves if m in DISTILL_ARMS and trl_s}
    summary = {"teacher_greedy": teacher_acc, "teacher_sampled": teacher_sampled, "reverse_kl_start": kl_start, "equal_time_s": t_equal,
               "figures": figures, "greedy": curves, "sampled": sampled, "final_kl": final_kl}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    fields = " ".join(f"{m.lower().replace('-', '')}_{k}={v:.3f}" for m in figures for k, v in figures[m].items())
    print(
        f"RESULT teacher={teacher_acc:.3f} reverse_kl_start={kl_start:.3f} {fields} "
        + " ".join(f"{k.replace('-', '')}={v:.2f}" for k, v in ratios.items())
        + f" equal_time_s={t_equal:.0f} seeds={len(args.seeds)} steps={args.distill_steps}/{args.grpo_steps}/{args.sft_arm_steps}"
    )


if __name__ == "__main__":
    main()
