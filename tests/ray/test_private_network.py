"""``trellis train`` with a private one-machine Ray cluster relaunches itself in a user + network
namespace with loopback only: the run's processes see no interface but ``lo``, so nothing Ray
starts can listen beyond this machine. A real CLI run in a subprocess, as a user types it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")

INTERFACES = '''
import json, os

def interfaces(data_source, solution_str, ground_truth, extra_info=None):
    """Scores 0, and records the network interfaces this process (the trainer) can see."""
    names = [line.split(":")[0].strip() for line in open("/proc/self/net/dev").read().splitlines()[2:]]
    with open(os.environ["SEEN_INTERFACES"], "w") as f:
        json.dump(names, f)
    return 0.0
'''


def user_namespaces() -> bool:
    return subprocess.run(["unshare", "--user", "--map-root-user", "--net", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not user_namespaces(), reason="this kernel allows no unprivileged user namespaces (the run falls back to token auth)")
def test_a_cli_ray_run_sees_only_loopback(tiny_model_path, tmp_path):
    from trellis_demo.tasks import make_arithmetic_split, write_rows

    data = write_rows(make_arithmetic_split(8, 0, max_value=50), tmp_path / "train.parquet")
    (tmp_path / "reward.py").write_text(INTERFACES)
    (tmp_path / "run.yaml").write_text("recipe: rl\n")
    seen = tmp_path / "seen.json"
    command = [
        sys.executable, "-m", "trellis.cli", "train", str(tmp_path / "run.yaml"), f"model.path={tiny_model_path}",
        f"data.train_path={data}", "data.train_batch_prompts=2", "sampling.n=2", "sampling.max_new_tokens=4",
        f"reward.path={tmp_path / 'reward.py'}", "reward.name=interfaces", "trainer.total_steps=1", "trainer.trackers=[jsonl]",
        "trainer.controller=ray", "trainer.procs_per_node=2", f"trainer.run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**env, "SEEN_INTERFACES": str(seen)})
    assert out.returncode == 0, out.stderr[-4000:]
    assert "the private cluster runs in a network namespace with loopback only" in out.stderr
    assert json.loads(seen.read_text()) == ["lo"]
    assert (tmp_path / "run" / "checkpoint-1").is_dir()  # the run's files are the user's, outside the namespace too
    assert os.stat(tmp_path / "run" / "metrics.jsonl").st_uid == os.getuid()
