"""The policy endpoint under Ray: an rl run with ``trainer.controller=ray`` whose samples are
episodes of a test agent on the real ``openai`` client; the endpoint starts beside the rank's
engine, in the rank's process, and the run trains on the trajectories it recorded there."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("openai")
pytest.importorskip("aiohttp")

AGENT = f"{Path(__file__).parents[1] / 'openai_agents.py'}:says_where_it_runs"
FOLLOW_UP = "again?"  # openai_agents.FOLLOW_UP


@pytest.fixture(scope="module")
def ray_cluster():
    """A private local cluster for this module: 3 logical CPUs (one rank, an engine process, a spare)."""
    ray.init(num_cpus=3, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="trellis-ray-test-"), log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("pool", [[], ["trainer.rollout_pool=1"]], ids=["colocated", "rollout pool"])
def test_openai_agent_episodes_run_against_an_endpoint_inside_the_rank(ray_cluster, tiny_model_path, tmp_path, pool):
    """Colocated, the endpoint runs in the actor rank's process; with a rollout pool, in the
    engine process's (either way not the driver's, and one process for the one engine)."""
    from trellis.recipes.train import train
    from trellis_demo.tasks import make_arithmetic_split, write_rows

    log = tmp_path / "agents.jsonl"
    rows = make_arithmetic_split(8, 0, max_value=30)
    for row in rows:
        row["extra_info"]["log"] = str(log)
    data = write_rows(rows, tmp_path / "train.parquet")
    run = tmp_path / "run"
    train(None, ["recipe=rl", f"model.path={tiny_model_path}", f"data.train_path={data}", "data.val_path=null",
                 "data.train_batch_prompts=2", "sampling.n=2", "sampling.max_new_tokens=6", "trainer.total_steps=2",
                 "trainer.trackers=[jsonl]", "trainer.log_samples=4", "trainer.controller=ray", "trainer.procs_per_node=1",
                 f"trainer.run_dir={run}", "multi_turn.enable=true", "multi_turn.agent_loop=openai_agent", f"multi_turn.agent={AGENT}",
                 "multi_turn.max_response_tokens=64", *pool])  # fmt: skip

    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in r]
    assert len(steps) == 2
    for r in steps:  # every sample: two trained calls, the agent's own end, no error (the rank checked trained ids == sampled ids)
        assert r["multiturn/num_turns_mean"] == 2.0 and r["multiturn/finish_done"] == 1.0 and r["multiturn/env_errors"] == 0
    episodes = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(episodes) == 2 * 2 * 2  # steps x prompts x samples
    assert {e["pid"] for e in episodes} != {os.getpid()} and len({e["pid"] for e in episodes}) == 1  # all in the one rank's process
    assert all(e["base_url"].startswith("http://127.0.0.1:") for e in episodes)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(FOLLOW_UP in s["conversation"] for s in samples)  # the agent's follow-up, between the two model turns
    for step, r in enumerate(steps):  # the rewards trained on are those the agents returned (steps run one after the other)
        returned = [e["reward"] for e in episodes[step * 4 : (step + 1) * 4]]
        assert r["reward/mean"] == pytest.approx(sum(returned) / 4, abs=1e-6)
    assert any(e["reward"] > 0 for e in episodes)  # the reward has a signal: not a default of 0 passing for the agent's
