"""A rollout pool apart from the trainer on a real local Ray cluster (loopback): the rl recipe with
one engine process equals the colocated run, a sync that skips a tensor stops naming it (both
transports), and a background thread generates while the main thread trains."""

from __future__ import annotations

import sys
import tempfile
import threading

import pytest
import torch
from omegaconf import OmegaConf

from trellis.config import ConfigError
from trellis_ray.pool import spawn_pool

ray = pytest.importorskip("ray")

import test_ray_controller as helpers  # noqa: E402 - the actor factory and GRPO batch of the Ray controller's tests
from engine_cases import check_engine_process_equals_rank, check_engine_process_one_step_ahead, rl_on_ray  # noqa: E402

SKIPPED = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def ray_cluster():
    """A private local cluster for this module: 3 logical CPUs (an actor rank, an engine process, a spare)."""
    for module in (sys.modules[__name__], helpers):
        ray.cloudpickle.register_pickle_by_value(module)
    ray.init(num_cpus=3, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="trellis-ray-test-"), log_to_driver=False)
    yield
    ray.shutdown()


def make_skipping_engine(spec):
    """The real HF rollout with a test-only fault: its load keeps its old value of ``SKIPPED``
    (the update's names and shapes still pass every check: only the digests can tell)."""
    from trellis_hf.engine import HFRollout

    class TensorSkippingHF(HFRollout):
        def load_weights(self, weights, shapes=None):
            state = self.model.state_dict()
            super().load_weights(((n, state[n].clone() if n == SKIPPED else t) for n, t in weights), shapes)

    return TensorSkippingHF(spec)


def pool_controller(transport: str = "object_store"):
    from trellis_ray.controller import RayController

    return RayController(nnodes=1, procs_per_node=1, timeout_s=60.0, call_timeout_s=120.0, rollout_pool=1, transport=transport)


def prompts_of(tokenizer, texts):
    from trellis.batch import Batch, position_ids
    from trellis.data import left_pad

    ids, mask, _ = left_pad([tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], tokenizer.pad_token_id or 0)
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask)})


def test_rl_with_an_engine_process_of_its_own_equals_the_colocated_run(ray_cluster, tiny_model_path, tmp_path):
    """Same seed, same samples, same updates: the engine is the same code on the same weights, only
    in another process (the check is every engine's: ``engine_cases``)."""
    check_engine_process_equals_rank(tiny_model_path, tmp_path)


# figures that depend on the clock, or exist only where generation runs ahead of training
AHEAD_ONLY = ("timing/", "dispatch/", "async/", "rollout/staleness")


def test_staleness_zero_on_ray_equals_the_synchronous_run(ray_cluster, tiny_model_path, tmp_path):
    """trainer.async_mode=fully_async with max_staleness=0: the producer thread generates each step
    after the previous one ended, so every figure equals the synchronous run's (colocated engine)."""
    off = rl_on_ray(tiny_model_path, tmp_path, "off")
    ahead = rl_on_ray(tiny_model_path, tmp_path, "ahead", "trainer.async_mode=fully_async", "trainer.max_staleness=0")
    assert all(r["actor/grad_norm"] > 0 for r in off)
    assert [{k: v for k, v in r.items() if not k.startswith(AHEAD_ONLY)} for r in ahead] == [
        {k: v for k, v in r.items() if not k.startswith(AHEAD_ONLY)} for r in off
    ]
    assert [r["rollout/staleness_max"] for r in ahead] == [0.0, 0.0, 0.0]


def test_one_step_ahead_with_an_engine_process_of_its_own(ray_cluster, tiny_model_path, tmp_path):
    """Generation on the pool's engine (weights broadcast over gloo) overlaps the actor's update:
    later steps train on samples one weight version old, and each sync's digests and probe pass."""
    check_engine_process_one_step_ahead(tiny_model_path, tmp_path, "trainer.weight_transport=broadcast")


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_a_sync_that_skips_a_tensor_stops_naming_the_step_engine_and_tensor(ray_cluster, tiny_model_path, transport):
    from transformers import AutoTokenizer

    from trellis import SyncCheckFailed
    from trellis.interfaces.rollout import RolloutSpec

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    batch = helpers.grpo_batch(tiny_model_path)
    ctrl = pool_controller(transport)
    try:
        actor = ctrl.spawn("actor", helpers.actor_factory(tiny_model_path))
        rollout = spawn_pool(ctrl, lambda: make_skipping_engine(RolloutSpec(tiny_model_path, None, tokenizer)), actor, 1)
        rollout.sync_weights(version=0)  # nothing trained yet: the kept value is the sent one
        batch["old_log_probs"] = actor.log_prob(batch)["log_probs"]
        actor.update(batch)
        with pytest.raises(SyncCheckFailed, match=rf"^step 1: .* rollout engine 0 of 1 \(TensorSkippingHF\) holds '{SKIPPED}' with digest "):
            rollout.sync_weights(version=1)
    finally:
        ctrl.shutdown()


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_generate_in_a_background_thread_while_the_actor_trains(ray_cluster, tiny_model_path, transport):
    """The lead's producer pattern: generation on the pool from a thread while the main thread
    updates the actor. Both finish; the thread's samples equal the same call made before (the
    engine holds the old weights until the sync), and after the sync the engine samples from the
    updated weights (its log-probs are the trainer's)."""
    from transformers import AutoTokenizer

    from trellis.interfaces.rollout import RolloutSpec, SamplingParams
    from trellis_hf.engine import make_engine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts = prompts_of(tokenizer, ["12+7=", "3+4=", "20+22="])
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=5)
    batch = helpers.grpo_batch(tiny_model_path)
    ctrl = pool_controller(transport)
    try:
        actor = ctrl.spawn("actor", helpers.actor_factory(tiny_model_path))
        rollout = spawn_pool(ctrl, lambda: make_engine(RolloutSpec(tiny_model_path, None, tokenizer)), actor, 1)
        before = rollout.generate(prompts, params)
        batch["old_log_probs"] = actor.log_prob(batch)["log_probs"]
        out: dict = {}
        thread = threading.Thread(target=lambda: out.update(samples=rollout.generate(prompts, params)))
        thread.start()
        metrics = actor.update(batch)
        thread.join(timeout=120)
        assert not thread.is_alive() and "samples" in out and metrics
        for key in ("responses", "rollout_log_probs"):
            assert torch.equal(out["samples"][key], before[key])
        assert (out["samples"]["weight_version"] == 0).all()

        rollout.sync_weights(version=1)
        after = rollout.generate(prompts, params)
        assert (after["weight_version"] == 1).all()
        trainer = actor.log_prob(after)["log_probs"]
        mask = after["response_mask"].bool()
        torch.testing.assert_close(after["rollout_log_probs"][mask], trainer[mask], atol=1e-4, rtol=0)
        # and the update moved the weights enough to tell: the old samples' log-probs changed
        old_mask = before["response_mask"].bool()
        assert not torch.allclose(actor.log_prob(before)["log_probs"][old_mask], before["rollout_log_probs"][old_mask], atol=1e-3)
    finally:
        ctrl.shutdown()


def test_rollout_pool_needs_ray_and_lifts_the_tensor_parallel_refusal():
    from trellis.runtime.controller import LocalController
    from trellis_ray.controller import RayController

    local = OmegaConf.create({"controller": "local", "rollout_pool": 2})
    with pytest.raises(ConfigError, match=r"'trainer.rollout_pool' is 2 with trainer.controller=local, .* set trainer.controller=ray \(pip install"):
        LocalController.check(local, 1)
    colocated = OmegaConf.create({"controller": "ray", "rollout_pool": 0})
    with pytest.raises(ConfigError, match=r"'rollout.tensor_parallel_size' is 2 .* set trainer.rollout_pool=N"):
        RayController.check(colocated, 2)
    RayController.check(OmegaConf.create({"controller": "ray", "rollout_pool": 1}), 2)  # an engine process spans its devices
