"""An RL run end to end on the tiny model with a code task, rewarded through the real sandbox server.

The random tiny model writes no working program, so this checks the plumbing, not learning: every
sample's reward came from the server (its run count rose by one per test case per sample) and the
result classes reached the run's metrics.
"""

from __future__ import annotations

import json

import pytest
from sandbox_server import start_server, stop

pytest.importorskip("trellis_fsdp", reason="the RL run needs trellis-backend-fsdp, trellis-rollout-hf and trellis-algos")

from trellis.recipes.train import train  # noqa: E402
from trellis_demo.tasks import write_rows  # noqa: E402

CLASSES = ("pass", "wrong_answer", "runtime_error", "timeout", "compile_error", "sandbox_error")


def code_rows(n: int) -> list[dict]:
    """'print the sum of the two numbers on stdin' prompts, two stdin/stdout cases each, in verl's schema."""
    rows = []
    for i in range(n):
        a, b = i, 2 * i + 1
        cases = {"inputs": [f"{a} {b}\n", f"{b} {a}\n"], "outputs": [f"{a + b}\n", f"{a + b}\n"]}
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"Print the sum of the two numbers on stdin ({a} {b})"}],
                "data_source": "code_sum",
                "reward_model": {"style": "rule", "ground_truth": json.dumps(cases)},
                "extra_info": {"index": i},
            }
        )
    return rows


def test_rl_on_a_code_task_is_rewarded_by_the_sandbox(tiny_model_path, tmp_path):
    srv = start_server(tmp_path / "home", "--workers", "2")
    try:
        data = write_rows(code_rows(8), tmp_path / "code.jsonl")
        runs_before = srv.stats()["runs"]
        steps, prompts, samples = 2, 2, 4
        train(
            None,
            [
                "recipe=rl",
                f"model.path={tiny_model_path}",
                f"data.train_path={data}",
                "data.max_prompt_length=128",
                f"data.train_batch_prompts={prompts}",
                f"sampling.n={samples}",
                "sampling.max_new_tokens=8",
                "actor.micro_batch_samples=8",
                f"trainer.total_steps={steps}",
                "trainer.trackers=[jsonl]",
                f"trainer.run_dir={tmp_path / 'run'}",
                "reward.name=sandbox_fusion",
                f"reward.kwargs={{url: '{srv.url}', run_timeout: 5}}",
                "reward.max_concurrency=8",
            ],
        )
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        stats = srv.stats()
    finally:
        stop(srv.proc)
    step_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in step_rows] == [1, 2]
    # two cases per sample, each run once, and the check's trivial program before anything was built
    assert stats["runs"] - runs_before == steps * prompts * samples * 2 + 1
    for row in step_rows:
        fractions = [row[f"reward/{c}"] for c in CLASSES]
        assert sum(fractions) == pytest.approx(1.0)  # every case landed in exactly one class
        assert row["reward/sandbox_error"] == 0.0 and row["reward/errors"] == 0.0
        assert row["reward/mean"] == pytest.approx(row["reward/pass"])  # fraction scoring: score = fraction passed
