"""The vLLM rollout under Ray on a real local cluster (loopback): built in the actor's rank process
beside FSDP, and in an engine process of its own (``trainer.rollout_pool``) fed by a weight
transport while the actor trains a step ahead. Each sync is checked by the probe (vLLM reports no
digests), so a lost sync would stop the run."""

from __future__ import annotations

import json
import sys
import tempfile

import pytest

ray = pytest.importorskip("ray")

# a reward with signal on an untrained model (every sync carries weights that moved): the response's length
LENGTH_REWARD = """
def length(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 20
"""


@pytest.fixture(scope="module")
def ray_cluster():
    """A private local cluster for this module: 3 logical CPUs (an actor rank, an engine process, a spare)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=3, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="trellis-ray-test-"), log_to_driver=False)
    yield
    ray.shutdown()


def vllm_on_ray(model_path, tmp_path, name, *overrides) -> list[dict]:
    """3 GRPO steps with ``rollout.name=vllm`` under ``trainer.controller=ray`` (one rank); the step rows."""
    from trellis.examples.tasks import make_arithmetic_split, write_rows
    from trellis.recipes.train import train

    data = write_rows(make_arithmetic_split(16, 0, max_value=50), tmp_path / "train.parquet")
    reward = tmp_path / "length.py"
    reward.write_text(LENGTH_REWARD)
    run = tmp_path / name
    train(None, ["recipe=rl", f"model.path={model_path}", f"data.train_path={data}", "data.train_batch_prompts=2", "sampling.n=4",
                 "sampling.max_new_tokens=5", "sampling.seed=11", f"reward.path={reward}", "reward.name=length", "actor.optim.lr=1e-2",
                 "rollout.name=vllm", "rollout.max_model_len=128", "trainer.total_steps=3", "trainer.trackers=[jsonl]",
                 "trainer.controller=ray", "trainer.procs_per_node=1", f"trainer.run_dir={run}", *overrides])  # fmt: skip
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def test_vllm_in_an_engine_process_of_its_own_equals_vllm_in_the_rank(ray_cluster, tiny_model_path, tmp_path):
    """vLLM built in the actor's rank process beside FSDP, then in an engine process of its own
    (``trainer.rollout_pool=1``, weights by the object store transport): the same seeds sample the
    same tokens and every learning figure matches; each sync lands (the probe's engine-vs-trainer
    gap stays at float32 noise while the policy moves)."""
    colocated = vllm_on_ray(tiny_model_path, tmp_path, "colocated")
    pooled = vllm_on_ray(tiny_model_path, tmp_path, "pooled", "trainer.rollout_pool=1")
    assert [r["step"] for r in colocated] == [r["step"] for r in pooled] == [1, 2, 3]
    for rows in (colocated, pooled):
        assert all(r["actor/grad_norm"] > 0 for r in rows)
        assert len({r["actor/entropy"] for r in rows}) == 3
        assert all(r["sync/probe_gap"] < 1e-3 for r in rows)
    skipped = ("timing/", "dispatch/", "sync/")
    for a, b in zip(colocated, pooled):
        keys = {k for k in a if not k.startswith(skipped)}
        assert {k: a[k] for k in keys if k.startswith(("reward/", "response/"))} == {k: b[k] for k in keys if k.startswith(("reward/", "response/"))}
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-5, abs=1e-5)


def test_vllm_in_an_engine_process_of_its_own_one_step_ahead(ray_cluster, tiny_model_path, tmp_path):
    """``trainer.rollout_pool=1``: vLLM in a process apart from the trainer, the weights sent by the
    object store transport, generation one step ahead of training; every sync lands (probe gap)."""
    rows = vllm_on_ray(tiny_model_path, tmp_path, "pooled", "trainer.rollout_pool=1", "trainer.async_mode=one_step")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    assert all(r["sync/probe_gap"] < 1e-3 for r in rows)
    assert [r["rollout/staleness_max"] for r in rows][1:] == [1.0, 1.0]  # later steps train on samples one version old
