"""The Ray controller on a real local Ray cluster (loopback): parity with the local controller,
placement that cannot be satisfied, a rank that dies mid-step, Ray missing, a recipe run."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

import pytest
import torch
from omegaconf import OmegaConf

from trellis.batch import Batch
from trellis.config import ConfigError, validate
from trellis.interfaces.dispatch import DP_SPLIT, Route
from trellis.plugins import load_plugins
from trellis.runtime.controller import LocalController
from trellis.runtime.worker import RoleWorker, Worker, WorkerSpec
from trellis_algos import ActorConfig
from trellis_fsdp.backend import FSDPBackend, FSDPOptions

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    """A private local cluster for this module (own temp dir; shut down after, never `ray stop`)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="trellis-ray-test-"), log_to_driver=False)
    yield
    ray.shutdown()


def controller(procs: int = 2, timeout: float = 60.0):
    from trellis_ray.controller import RayController

    return RayController(nnodes=1, procs_per_node=procs, timeout_s=timeout, call_timeout_s=120.0)


def grpo_batch(tiny_model_path) -> Batch:
    """8 samples with responses, old log-probs and advantages: one GRPO step's actor input."""
    from transformers import AutoModelForCausalLM

    vocab = AutoModelForCausalLM.from_pretrained(tiny_model_path).config.vocab_size
    g = torch.Generator().manual_seed(0)
    n, p, r = 8, 4, 5
    resp_mask = (torch.arange(r) < torch.randint(1, r + 1, (n,), generator=g)[:, None]).long()
    mask = torch.cat([torch.ones(n, p, dtype=torch.long), resp_mask], 1)
    responses = torch.randint(3, vocab, (n, r), generator=g) * resp_mask
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    adv = (scores - scores.view(2, 4).mean(1).repeat_interleave(4)) / (scores.view(2, 4).std(1).repeat_interleave(4) + 1e-6)
    return Batch(
        {
            "input_ids": torch.cat([torch.randint(3, vocab, (n, p), generator=g), responses], 1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": resp_mask,
            "advantages": adv[:, None] * resp_mask,
        },
        meta={"temperature": 1.0},
    )


def actor_factory(tiny_model_path):
    registry = load_plugins().registry
    options = validate(OmegaConf.create({"optim": {"lr": 1e-2}, "micro_batch_samples": 2, "mini_batch_samples": 4}), ActorConfig, registry)
    spec = WorkerSpec("actor", tiny_model_path, FSDPBackend, FSDPOptions(), options, {"update": "policy"}, registry=registry)
    return lambda dist: RoleWorker(dataclasses.replace(spec, dist=dist))


def grpo_step(ctrl, make, batch):
    actor = ctrl.spawn("actor", make)
    batch["old_log_probs"] = actor.log_prob(batch)["log_probs"]
    metrics = actor.update(batch)
    weights = dict(w for bucket in actor.export_weights() for w in bucket)
    return batch["old_log_probs"], metrics, weights


def test_ray_two_ranks_match_local_one_rank(ray_cluster, tiny_model_path):
    make = actor_factory(tiny_model_path)
    batch = grpo_batch(tiny_model_path)
    ray_ctrl = controller(2)
    try:
        ray_lp, ray_metrics, ray_weights = grpo_step(ray_ctrl, make, Batch(batch.tensors.clone(), meta=batch.meta))
    finally:
        ray_ctrl.shutdown()
    local_lp, local_metrics, local_weights = grpo_step(LocalController(), make, batch)
    torch.distributed.destroy_process_group()
    torch.testing.assert_close(ray_lp, local_lp, atol=1e-5, rtol=0)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert ray_metrics[key] == pytest.approx(local_metrics[key], abs=1e-5), key
    assert set(ray_weights) == set(local_weights)
    for name, tensor in local_weights.items():
        torch.testing.assert_close(ray_weights[name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_unsatisfiable_placement_fails_fast_with_resources(ray_cluster):
    expected = r"could not place pool 'actor' within trainer.ray_timeout_s=2 s: it asks for 1 node\(s\) with 3 x \{'CPU': 1\} each"
    with pytest.raises(RuntimeError, match=expected):
        controller(procs=3, timeout=2.0).spawn("actor", lambda dist: None)


class DiesOnRankOne(Worker):
    """Test-only worker: rank 1's process exits in the middle of ``log_prob``."""

    def __init__(self, dist):
        self.dist = dist

    def build(self):
        pass

    def routes(self):
        return {**super().routes(), "log_prob": Route(DP_SPLIT, None)}

    def log_prob(self, batch, with_entropy=False):
        if self.dist.rank == 1:
            os._exit(1)
        return Batch({"log_probs": torch.zeros(len(batch), 1)})


def test_dead_rank_fails_the_step_with_role_rank_and_node(ray_cluster):
    ctrl = controller(2)
    try:
        group = ctrl.spawn("actor", DiesOnRankOne)
        with pytest.raises(Exception, match=r"role 'actor' rank 1 on node \S+ failed in actor.log_prob") as err:
            group.log_prob(Batch({"x": torch.zeros(4, 1)}))
        assert "resumed from its last checkpoint" in str(err.value)
    finally:
        ctrl.shutdown()


def test_copy_weights_and_agenerate_reach_the_ranks(ray_cluster, tiny_model_path):
    """ref <- actor in memory on every rank, and one async sample through a rank's engine."""
    import asyncio

    from transformers import AutoTokenizer

    from trellis.interfaces.rollout import RolloutSpec, SamplingParams
    from trellis_hf.engine import make_engine

    make = actor_factory(tiny_model_path)
    registry = load_plugins().registry
    spec = WorkerSpec("ref", tiny_model_path, FSDPBackend, FSDPOptions(), None, registry=registry)
    batch = grpo_batch(tiny_model_path)
    ctrl = controller(2)
    try:
        actor = ctrl.spawn("actor", make)
        ref = ctrl.spawn("ref", lambda dist: RoleWorker(dataclasses.replace(spec, dist=dist)))
        batch["old_log_probs"] = actor.log_prob(batch)["log_probs"]
        actor.update(batch)
        moved = actor.log_prob(batch)["log_probs"]
        assert not torch.allclose(ref.log_prob(batch)["log_probs"], moved, atol=1e-4)
        ctrl.copy_weights(actor, ref)
        torch.testing.assert_close(ref.log_prob(batch)["log_probs"], moved, atol=1e-6, rtol=0)

        tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
        rollout = ctrl.spawn_rollout(lambda: make_engine(RolloutSpec(tiny_model_path, None, tokenizer)), actor)
        prompt = tokenizer("12+7=", add_special_tokens=False)["input_ids"]
        params = SamplingParams(max_new_tokens=5, greedy=True)

        async def two():
            return await asyncio.gather(rollout.agenerate(prompt, params), rollout.agenerate(prompt, params))

        first, second = asyncio.run(two())
        expected = asyncio.run(make_engine(RolloutSpec(tiny_model_path, None, tokenizer)).agenerate(prompt, params))
        assert first.token_ids == second.token_ids == expected.token_ids and first.finish_reason in ("stop", "length")
    finally:
        ctrl.shutdown()


def rl_on_two_ray_ranks(model_path, tmp_path, *overrides: str, plugins=None, val_prompts: int = 6) -> dict:
    """Two steps of the rl recipe on 2 Ray ranks of one node, 4 prompts a step, held-out prompts."""
    from trellis.recipes.train import train
    from trellis_demo.tasks import make_arithmetic_split, write_rows

    data = write_rows(make_arithmetic_split(32, 0, max_value=50), tmp_path / "train.parquet")
    val = write_rows(make_arithmetic_split(val_prompts, 0, split="test", max_value=50), tmp_path / "val.parquet")
    common = [f"model.path={model_path}", f"data.train_path={data}", f"data.val_path={val}", "data.train_batch_prompts=4",
              "trainer.total_steps=2", "trainer.trackers=[jsonl]", "trainer.controller=ray", "trainer.procs_per_node=2",
              f"trainer.run_dir={tmp_path / 'run'}"]  # fmt: skip
    return train(None, ["recipe=rl", *common, *overrides], plugins=plugins)


def test_rl_recipe_runs_on_two_ray_ranks(ray_cluster, tiny_model_path, tmp_path):
    summary = rl_on_two_ray_ranks(tiny_model_path, tmp_path, "sampling.n=4", "sampling.max_new_tokens=6", "actor.use_kl_loss=true")
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    # each verb ships only the fields it reads: far less than the whole batch
    assert 0 < steps[0]["dispatch/sent_mb"] < 0.7 * steps[0]["dispatch/batch_mb"]
    assert 0.0 <= summary["val_after"]["reward_mean"] <= 1.0
    # the final checkpoint: each rank wrote its own shard; one rank reads them all back for an export
    from trellis.export import export_checkpoint
    from trellis.runtime.checkpoint import read_manifest

    files = read_manifest(tmp_path / "run" / "checkpoint-2")["files"]
    assert {"actor/__0_0.distcp", "actor/__1_0.distcp", "actor/rank0.pt", "actor/rank1.pt"} <= set(files)
    assert (export_checkpoint(tmp_path / "run", tmp_path / "hf") / "model.safetensors").is_file()


def test_critic_on_a_pool_of_its_own(ray_cluster, tiny_model_path, tmp_path):
    """PPO with GAE: actor+ref+rollout in one pool, the critic in another (1 rank each)."""
    from trellis.recipes.train import train
    from trellis_demo.tasks import make_arithmetic_split, write_rows

    data = write_rows(make_arithmetic_split(16, 0, max_value=50), tmp_path / "train.parquet")
    train(
        None,
        [
            "recipe=rl",
            f"model.path={tiny_model_path}",
            f"data.train_path={data}",
            "data.train_batch_prompts=2",
            "sampling.n=2",
            "sampling.max_new_tokens=4",
            "algorithm.advantage.name=gae",
            "trainer.total_steps=1",
            "trainer.trackers=[jsonl]",
            "trainer.controller=ray",
            "trainer.separate_pools=[critic]",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    assert "critic/vf_loss" in (tmp_path / "run" / "metrics.jsonl").read_text()


def test_ray_address_joins_an_existing_cluster_and_leaves_it_running(ray_cluster, tmp_path):
    """A second process with RAY_ADDRESS set joins this test's cluster, places a pool there and, on
    shutdown, removes only what it made: the cluster (someone else's Ray) keeps running."""
    import subprocess

    script = tmp_path / "join.py"
    script.write_text(
        "from trellis_ray.controller import RayController\n"
        "c = RayController(nnodes=1, procs_per_node=1, timeout_s=30, call_timeout_s=60)\n"
        "pool = c._pool('actor')\n"
        "print('joined', c.started_cluster, c.ray.get_runtime_context().gcs_address, len(pool.nodes))\n"
        "c.shutdown()\n"
    )
    address = ray.get_runtime_context().gcs_address
    out = subprocess.run([sys.executable, str(script)], env={**os.environ, "RAY_ADDRESS": address}, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"joined False {address} 1" in out.stdout
    assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 2.0
    assert ray.util.placement_group_table() == {} or all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_the_cluster_trellis_starts_runs_its_ranks_at_the_default_niceness(tmp_path):
    """Ray starts the workers of a cluster that ray.init starts at niceness 15, where any neighbour
    process takes their cores (the async bench beside a busy process got ~3% of a core per rank):
    the private cluster the controller starts runs its ranks at 0 and leaves the environment as it was."""
    import subprocess

    script = tmp_path / "nice.py"
    script.write_text(
        "import os\n"
        "from trellis_ray.controller import RayController\n"
        "c = RayController(nnodes=1, procs_per_node=1, timeout_s=60, call_timeout_s=60)\n"
        "pool = c._pool('actor')\n"
        "print('rank niceness', c.ray.get(pool.ranks[0].__ray_call__.remote(lambda rank: os.nice(0))), 'started', c.started_cluster)\n"
        "c.shutdown()\n"
        "print('left in the environment:', 'RAY_worker_niceness' in os.environ)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, str(script)], env={**env, "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rank niceness 0 started True" in out.stdout and "left in the environment: False" in out.stdout


def test_ranks_are_packed_one_placement_group_per_node(tmp_path):
    """Two Ray nodes of 2 CPUs on this machine (``ray.cluster_utils.Cluster``, in a subprocess:
    its own cluster) and nnodes=2 x procs_per_node=2: each node's 2 ranks in one STRICT_PACK
    placement group, so ranks 0-1 share a node and ranks 2-3 the other (not SPREAD over both)."""
    import subprocess

    script = tmp_path / "placement.py"
    script.write_text(
        "import ray\n"
        "from ray.cluster_utils import Cluster\n"
        "from trellis_ray.controller import RayController\n"
        "cluster = Cluster(initialize_head=True, head_node_args={'num_cpus': 2})\n"
        "cluster.add_node(num_cpus=2)\n"
        "ray.init(address=cluster.address)\n"
        "c = RayController(nnodes=2, procs_per_node=2, timeout_s=60, call_timeout_s=60)\n"
        "pool = c._pool('actor')\n"
        "nodes = [ray.util.placement_group_table(pg)['bundles_to_node_id'] for pg in pool.pgs]\n"
        "print('strategies', [ray.util.placement_group_table(pg)['strategy'] for pg in pool.pgs])\n"
        "print('nodes per group', [len(set(b.values())) for b in nodes], 'groups on distinct nodes', len({n for b in nodes for n in b.values()}))\n"
        "c.shutdown()\n"
        "ray.shutdown()\n"
        "cluster.shutdown()\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "strategies ['STRICT_PACK', 'STRICT_PACK']" in out.stdout
    assert "nodes per group [1, 1] groups on distinct nodes 2" in out.stdout


def test_spin_recipe_on_two_ray_ranks_refreshes_the_reference_in_memory(ray_cluster, tiny_model_path, tmp_path):
    """SPIN on 2 ranks: every step's pairs start from policy == reference (margin 0) only if the
    reference took the actor's weights on every rank after the step before."""
    from trellis.recipes.train import train
    from trellis_demo.tasks import make_arithmetic_split, write_rows

    data = write_rows(make_arithmetic_split(16, 0, max_value=50), tmp_path / "train.parquet")
    train(
        None,
        [
            "recipe=spin",
            f"model.path={tiny_model_path}",
            f"data.train_path={data}",
            "data.train_batch_prompts=2",
            "sampling.n=2",
            "sampling.max_new_tokens=4",
            "train.optim.lr=1e-3",
            "ref_update_every=1",
            "trainer.total_steps=2",
            "trainer.trackers=[jsonl]",
            "trainer.controller=ray",
            "trainer.procs_per_node=2",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    steps = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["spin/pairs"] for s in steps] == [4.0, 4.0]
    assert all(s["actor/reward_margin"] == pytest.approx(0.0, abs=1e-5) and s["actor/grad_norm"] > 0 for s in steps)


def test_agent_loops_run_next_to_each_engine(ray_cluster, tiny_model_path):
    """Conversations dealt over two ranks' engines, each row through the agent loop it names (the
    default ``tool_agent`` with the gsm8k interaction, or the test-only ``observation_first``,
    pickled to the ranks), come back as the same trajectories (greedy) as on one local engine."""
    import agent_loops
    from transformers import AutoTokenizer

    from trellis.interfaces.rollout import RolloutSpec, SamplingParams
    from trellis.runtime.controller import LocalRollout
    from trellis_algos import PromptDataset
    from trellis_algos.rl.multi_turn import MultiTurnConfig
    from trellis_demo.tasks import make_arithmetic_split
    from trellis_hf.engine import make_engine
    from trellis_multiturn.environment import agent_spec
    from trellis_multiturn.rollout import agent_rollout

    ray.cloudpickle.register_pickle_by_value(agent_loops)
    registry = load_plugins(extra=[("agent_loops", agent_loops)]).registry
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    section = {"enable": True, "max_assistant_turns": 2, "max_response_tokens": 40, "interactions": [{"name": "gsm8k", "component": "gsm8k"}]}
    spec = agent_spec(validate(OmegaConf.create(section), MultiTurnConfig, registry, "multi_turn."), registry, tokenizer)
    rows = make_arithmetic_split(4, 0, max_value=30, interaction="gsm8k")
    for row in rows[1::2]:
        row["agent_name"] = "observation_first"
    agent = agent_rollout(spec, registry, {"rows": enumerate(r.get("agent_name") for r in rows)})
    prompts = PromptDataset(rows, tokenizer, 64).as_batch()
    params = SamplingParams(n=2, greedy=True, max_new_tokens=5)
    local = LocalRollout(make_engine(RolloutSpec(tiny_model_path, None, tokenizer)), None).rollout(prompts, params, agent)
    ctrl = controller(2)
    try:
        actor = ctrl.spawn("actor", actor_factory(tiny_model_path))
        rollout = ctrl.spawn_rollout(lambda: make_engine(RolloutSpec(tiny_model_path, None, tokenizer)), actor)
        dealt = rollout.rollout(prompts, params, agent)
    finally:
        ctrl.shutdown()
    assert len(dealt) == 8 and dealt["num_turns"].tolist() == local["num_turns"].tolist() == [2, 2, 1, 1] * 2
    assert list(dealt["agent_name"]) == list(local["agent_name"]) == (["tool_agent"] * 2 + ["observation_first"] * 2) * 2
    assert list(dealt["finish_reason"])[2:4] == ["answered"] * 2 and dealt["response_mask"][2, 0].item() == 0  # the environment spoke first
    width = local["responses"].shape[1]
    for key in ("responses", "response_mask", "attention_mask"):
        assert torch.equal(dealt[key][:, : local[key].shape[1]], local[key]), key
    assert list(dealt["turn_scores"]) == list(local["turn_scores"]) and list(dealt["uid"]) == list(local["uid"])
    assert width == dealt["responses"].shape[1]


# -- rollout memory, seeds, context length and rank environment, seen from inside the ranks ---------
@dataclasses.dataclass
class RecordingOptions:
    """The HF rollout's options plus where to record, and a tensor-parallel size to refuse."""

    log_dir: str = ""
    tensor_parallel_size: int = 1
    dtype: str = "float32"
    micro_batch_prompts: int = 0
    device: str = "auto"
    share_prompts: bool = True


def make_recording_engine(spec):
    """The real HF rollout, recording every interface call in order to a file per rank process
    (the calls happen inside the Ray ranks, where the test cannot look)."""
    from trellis.interfaces.rollout import ALL_MEMORY
    from trellis_hf.engine import HFRollout

    class RecordingHF(HFRollout):
        def __init__(self, spec) -> None:
            super().__init__(spec)
            self.log = os.path.join(spec.options.log_dir, f"{os.getpid()}.jsonl")
            env = {k: os.environ.get(k) for k in ("LOCAL_RANK", "NCCL_DEBUG", "HF_HOME")}
            self._record("build", max_len=spec.max_len, env=env)

        def _record(self, call, **info) -> None:
            with open(self.log, "a") as f:
                f.write(json.dumps({"call": call, **info}) + "\n")

        def generate(self, prompts, params):
            self._record("generate", seed=params.seed, greedy=params.greedy, prompts=len(prompts))
            return super().generate(prompts, params)

        def load_weights(self, weights, shapes=None):
            self._record("load_weights")
            super().load_weights(weights, shapes)

        def sleep(self):
            self._record("sleep")

        def wake(self, tags=ALL_MEMORY):
            self._record("wake", tags=list(tags))

        def close(self):
            self._record("close")

    return RecordingHF(spec)


def recording_plugins():
    plugins = load_plugins()
    if "recording_hf" not in plugins.registry.names("rollout"):
        plugins.registry.adding_for("test_ray_controller")
        plugins.registry.add("rollout", "recording_hf", make_recording_engine, options=RecordingOptions)
    return plugins


def test_rl_on_ray_sleeps_the_engines_after_generation_and_wakes_weights_then_cache_for_the_sync(ray_cluster, tiny_model_path, tmp_path, monkeypatch):
    """Every rank's engine, through the rl recipe: built with the recipe's prompt + response length,
    sleep after each generation (validation too), then wake(weights) -> load -> wake(kv_cache) at the sync,
    then one greedy probe prompt per engine (the sync check);
    per-request seeds (opted in) are the step's base plus each rank's first global sample index;
    the ranks get LOCAL_RANK from their place on the node and the driver's NCCL_* / HF_HOME; the
    engines are closed at shutdown."""
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("LOCAL_RANK", "5")  # as a torchrun-launched driver would have: not the ranks' own
    logs = tmp_path / "calls"
    logs.mkdir()
    overrides = ["data.max_prompt_length=40", "sampling.n=2", "sampling.max_new_tokens=5", "sampling.seed=11", "rollout.name=recording_hf",
                 f"rollout.log_dir={logs}"]  # fmt: skip
    rl_on_two_ray_ranks(tiny_model_path, tmp_path, *overrides, plugins=recording_plugins(), val_prompts=4)
    ranks = [[json.loads(line) for line in f.read_text().splitlines()] for f in sorted(logs.iterdir())]
    assert len(ranks) == 2
    builds = [calls[0] for calls in ranks]
    assert {b["max_len"] for b in builds} == {40 + 5}
    assert sorted(b["env"]["LOCAL_RANK"] for b in builds) == ["0", "1"]
    assert all(b["env"]["NCCL_DEBUG"] == "WARN" and b["env"]["HF_HOME"] == str(tmp_path / "hf-home") for b in builds)
    step = ["generate", "sleep", "wake", "load_weights", "wake", "generate"]  # the last: the sync check's greedy probe
    validation = ["generate", "generate", "sleep"]  # greedy, sampled; the engines sleep after it as after any generation
    for calls in ranks:
        names = [c["call"] for c in calls]
        # build, validation, a wake (no sync followed it), 2 steps, validation, close
        assert names == ["build", *validation, "wake", *step, *step, *validation, "close"]
        wakes = [c["tags"] for c in calls if c["call"] == "wake"]
        assert wakes == [["weights", "kv_cache"]] + [["weights"], ["kv_cache"]] * 2
    # 4 prompts x 2 samples a step, 2 prompts per rank: rank 1's first sample is the step's 4th
    train_seeds = sorted(c["seed"] for calls in ranks for c in calls[5 : 5 + 2 * len(step)] if c["call"] == "generate" and not c["greedy"])
    probes = [c for calls in ranks for c in calls[5 : 5 + 2 * len(step)] if c["call"] == "generate" and c["greedy"]]
    assert len(probes) == 2 * 2 and all(c["prompts"] == 1 for c in probes)  # each engine checked after each sync
    assert train_seeds[:4] == [11, 11 + 4, 11 + 8, 11 + 8 + 4]


def test_tensor_parallel_engines_under_ray_are_refused_at_config_time(tiny_model_path, tmp_path):
    from trellis.recipes.train import train
    from trellis_demo.tasks import make_arithmetic_split, write_rows

    data = write_rows(make_arithmetic_split(8, 0, max_value=50), tmp_path / "train.parquet")
    overrides = [f"model.path={tiny_model_path}", f"data.train_path={data}", "rollout.name=recording_hf", "rollout.tensor_parallel_size=2",
                 "trainer.controller=ray", "trainer.procs_per_node=2", f"trainer.run_dir={tmp_path / 'run'}"]  # fmt: skip
    refused = r"'rollout.tensor_parallel_size' is 2 with trainer.controller=ray: .* set trainer.rollout_pool=N .* rollout.tensor_parallel_size=1"
    with pytest.raises(ConfigError, match=refused):
        train(None, ["recipe=rl", *overrides], plugins=recording_plugins())
    assert not (tmp_path / "run").exists()
