"""verl's dense Megatron GRPO launch script (``tests/verl_compat/launch/megatron.sh``), converted by
``trellis config from-verl`` with only the model, the data, the sizes and the engine overridden,
trains 2 steps on trellis's megatron backend at the script's tensor-parallel size (2 CPU ranks under
the Ray controller, as the script's GPUs would be)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from cli_runs import run_cli as trellis
from ranks import boot_env

from trellis_demo.tasks import make_arithmetic_split, write_rows

SCRIPT = Path(__file__).parents[1] / "verl_compat" / "launch" / "megatron.sh"
TRAIN = "import sys; from trellis.recipes.train import train; train(sys.argv[1], sys.argv[2:])"
# a random tiny model never answers: a reward of the text alone, so advantages are not all 0
REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return sum(map(ord, solution_str)) % 7 / 7\n"


def test_verls_megatron_script_trains_on_the_megatron_backend_at_its_tensor_parallel_size(tiny_model_path, tmp_path):
    rows = make_arithmetic_split(16, 0, max_value=9)
    (tmp_path / "reward.py").write_text(REWARD)
    given = [
        f"actor_rollout_ref.model.path={tiny_model_path}",
        f"data.train_files={write_rows(rows, tmp_path / 'train.parquet')}",
        "data.val_files=null",
        f"custom_reward_function.path={tmp_path / 'reward.py'}",
        "data.train_batch_size=4",
        "data.max_prompt_length=32",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",  # 2 ranks: tensor parallel only
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=2",
        "trainer.logger=['console']",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
    ]
    out = trellis("config", "from-verl", str(SCRIPT), *given, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["backend"] == {"name": "megatron", "tensor_parallel": 2, "pipeline_parallel": 1}
    assert (cfg["trainer"]["controller"], cfg["trainer"]["procs_per_node"]) == ("ray", 2)
    (tmp_path / "run.yaml").write_text(out.stdout)
    run_dir = tmp_path / "run"
    args = ["-c", TRAIN, str(tmp_path / "run.yaml"), f"trainer.run_dir={run_dir}", "trainer.trackers=[jsonl]", "trainer.threads=1"]
    done = subprocess.run([sys.executable, *args], cwd=tmp_path, env=boot_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in r]
    assert len(steps) == 2 and all(s["actor/grad_norm"] > 0 and s["actor/kl_loss"] >= 0 for s in steps)
