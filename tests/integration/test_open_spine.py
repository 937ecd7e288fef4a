"""The spine opened from outside core: the harness's generation choreography holds for every
generating recipe (checked with stand-ins that enforce sleep mode on CPU), and plugins bring their
own controller and reward service. (A plugin recipe with a role, verb and kind of its own:
test_outside_plugin.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import spine_plugins  # noqa: E402  (test-only plugins beside this file)

from trellis.plugins import load_plugins  # noqa: E402
from trellis.recipes.train import train  # noqa: E402

CONSTANT_REWARD = '''
def same_for_all(data_source, solution_str, ground_truth, extra_info=None):
    """Every sample ties: ranked pairs find none."""
    return 0.0
'''


@pytest.fixture
def plugins():
    spine_plugins.EVENTS.clear()
    spine_plugins.LAST_METRICS.clear()
    return load_plugins(extra=[("spine_test", spine_plugins.SpinePlugin())])


def _spin(plugins, tiny_model_path, data_files, run_dir, *overrides):
    return train(
        None,
        [
            "recipe=spin",
            f"model.path={tiny_model_path}",
            f"data.train_path={data_files['train']}",
            f"data.val_path={data_files['test']}",
            "data.train_batch_prompts=4",
            "sampling.n=2",
            "sampling.max_new_tokens=4",
            "train.micro_batch_samples=4",
            "trainer.total_steps=3",
            "trainer.trackers=[jsonl]",
            f"trainer.run_dir={run_dir}",
            "rollout.name=strict_sleep",
            "backend.name=recording",
            *overrides,
        ],
        plugins=plugins,
    )


def test_spin_steps_without_pairs_leave_the_engine_able_to_generate(plugins, tiny_model_path, data_files, tmp_path):
    """pairs: ranked with a reward that ties every sample: no pairs, no update, no weight sync.
    The engine slept after generating; the next step must wake it (on vLLM or SGLang with sleep
    mode, generating on a sleeping engine raises)."""
    reward = tmp_path / "constant.py"
    reward.write_text(CONSTANT_REWARD)
    _spin(plugins, tiny_model_path, data_files, tmp_path / "spin", "pairs=ranked", f"reward.path={reward}", "reward.name=same_for_all")
    rows = [r for r in _rows(tmp_path / "spin") if "spin/pairs" in r]
    assert [r["spin/pairs"] for r in rows] == [0.0, 0.0, 0.0]
    assert "load_weights" not in spine_plugins.EVENTS  # nothing trained, nothing synced
    assert spine_plugins.EVENTS.count("generate") == 3 + 2  # the steps' samples and the two validations


@pytest.mark.parametrize("recipe", ["spin", "rl"])
def test_generating_offloads_every_role_and_sleeps_the_engine(recipe, plugins, tiny_model_path, data_files, tmp_path):
    """Each step: every role offloads, the engine generates, sleeps, the roles onload, and the
    weight sync (engine woken) follows training; validation after training is in run.metrics."""
    if recipe == "spin":
        _spin(plugins, tiny_model_path, data_files, tmp_path / "spin", "pairs=reference")
    else:
        train(None, [*_rl_base(tiny_model_path, data_files, tmp_path / "rl"), "actor.use_kl_loss=true"], plugins=plugins)
    roles = ["actor", "ref"]
    events = spine_plugins.EVENTS
    offloads, onloads = [f"offload {r}" for r in roles], [f"onload {r}" for r in roles]
    blocks = 0  # validation before, 3 steps, validation after: each offload .. generate(s) .. sleep .. onload
    at = 0  # (a block after one that no weight sync followed first wakes the engine)
    while offloads[0] in events[at:]:
        at = events.index(offloads[0], at)
        end = events.index(onloads[-1], at) + 1
        block = events[at:end]
        generated, woken = block.count("generate"), ["wake"] * (at > 0 and events[at - 1] == onloads[-1])
        assert generated >= 1 and block == [*offloads, *woken, *["generate"] * generated, "sleep", *onloads], events
        blocks, at = blocks + 1, end
    assert blocks == 5, events
    syncs = [i for i, e in enumerate(events) if e == "load_weights"]
    assert len(syncs) == 3, events
    for i in syncs:  # a sync wakes the sleeping weights, loads, then wakes the KV cache
        assert events[i - 1] == "wake" and events[i + 1] == "wake"
    assert "val/greedy_reward_mean" in spine_plugins.LAST_METRICS


def _rl_base(tiny_model_path, data_files, run_dir):
    return [
        "recipe=rl",
        f"model.path={tiny_model_path}",
        f"data.train_path={data_files['train']}",
        f"data.val_path={data_files['test']}",
        "data.train_batch_prompts=4",
        "sampling.n=2",
        "sampling.max_new_tokens=4",
        "actor.micro_batch_samples=8",
        "trainer.total_steps=3",
        "trainer.trackers=[jsonl]",
        f"trainer.run_dir={run_dir}",
        "rollout.name=strict_sleep",
        "backend.name=recording",
    ]


def _rows(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_plugin_controller_places_the_roles_and_trains_as_local_does(run_rl, tmp_path):
    """trainer.controller names a registered controller (kind ``controller``): the example plugin's
    builds the run's roles (core's local controller underneath), and the step's figures equal local's."""
    from trellis_example.plugin import CountingController

    CountingController.spawned.clear()
    _, counted = run_rl("trainer.controller=example_counting", "trainer.total_steps=1", run_dir=tmp_path / "counted")
    assert CountingController.spawned and CountingController.spawned[0] == "actor", CountingController.spawned
    _, local = run_rl("trainer.total_steps=1", run_dir=tmp_path / "local")
    step = [r for r in counted if r.get("step") == 1][0]
    assert len(step) > 10 and "reward/mean" in step, sorted(step)
    assert {k: v for k, v in step.items() if not k.startswith(("timing/", "perf/"))} == {
        k: v for k, v in [r for r in local if r.get("step") == 1][0].items() if not k.startswith(("timing/", "perf/"))
    }


def test_a_plugin_reward_service_the_reward_asks_for_is_started_and_wraps_the_scorer(run_rl, tmp_path):
    """Kind ``reward_service``: the example plugin's service is wanted by runs rewarded with its
    ``example_length`` reward; the run starts it and its figures join each step's metrics."""
    _, rows = run_rl("reward.name=example_length", "data.val_path=null", run_dir=tmp_path / "counted")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["example/scored_batches"] for r in steps] == [1, 2]  # one scoring per step (validation off)
    assert [r["example/scored_samples"] for r in steps] == [16, 32]  # 4 prompts x 4 samples each
    _, plain = run_rl("data.val_path=null", run_dir=tmp_path / "gsm8k")
    assert not any(k.startswith("example/") for r in plain for k in r)  # another reward does not want it
