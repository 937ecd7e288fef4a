"""The rl recipe on image prompts (verl's multimodal parquet) with the tiny Qwen2-VL: it trains,
the engine's weights are synced and checked with an image prompt, and a sync that leaves the vision
tower behind stops the run."""

from __future__ import annotations

import json

import pytest
from images import image_row, squares

from trellis import SyncCheckFailed
from trellis.config import ConfigError
from trellis.plugins import load_plugins
from trellis.recipes.train import train
from trellis_demo.tasks import write_rows
from trellis_fsdp.backend import FSDPBackend

REWARD = "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return len(solution_str) / 20\n"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-data")
    rows = [
        image_row("<image>how many squares?", [squares(color, count, (56 + 28 * (i % 3), 56))], str(count), i)
        for i, (color, count) in enumerate([(c, k) for c in ("red", "green", "blue") for k in (1, 2, 3)] * 2)
    ]
    rows[0] = {**image_row("how many squares?", [], "1"), "images": None}  # a text row among them
    (folder / "reward.py").write_text(REWARD)
    return {"train": write_rows(rows, folder / "train.parquet"), "val": write_rows(rows[:4], folder / "val.parquet"), "reward": folder / "reward.py"}


def run(path, data, run_dir, *overrides, plugins=None):
    train(
        None,
        [
            "recipe=rl",
            f"model.path={path}",
            f"data.train_path={data['train']}",
            f"data.val_path={data['val']}",
            "data.train_batch_prompts=4",
            "sampling.n=4",
            "sampling.max_new_tokens=6",
            "actor.micro_batch_samples=8",
            "actor.optim.lr=1e-2",
            f"reward.path={data['reward']}",
            "reward.name=score",
            "rollout.share_actor_weights=false",  # the engine keeps its own copy: every step syncs it
            "trainer.total_steps=2",
            "trainer.trackers=[jsonl]",
            f"trainer.run_dir={run_dir}",
            *overrides,
        ],
        plugins,
    )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rl_trains_on_image_prompts_with_every_sync_checked_on_an_image(tiny_vision_model_path, data, tmp_path):
    rows = [r for r in run(tiny_vision_model_path, data, tmp_path / "run") if "actor/grad_norm" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["actor/grad_norm"] > 0
        assert row["sync/batch_gap"] < 1e-4  # the trainer's log-probs of the samples, images included, equal the engine's
        assert row["sync/probe_gap"] < 1e-4


def test_a_sync_that_leaves_the_vision_tower_behind_stops_the_run(tiny_vision_model_path, data, tmp_path, monkeypatch):
    """A backend whose export (its tensors and their manifest alike) has no vision tower: every
    tensor it sends loads, and only the probe, an image prompt, sees the engine's stale tower."""
    export, shapes = FSDPBackend.export_weights, FSDPBackend.weight_shapes

    def without_vision(self, *args, **kwargs):
        for bucket in export(self, *args, **kwargs):
            yield [(name, tensor) for name, tensor in bucket if ".visual." not in name]

    monkeypatch.setattr(FSDPBackend, "export_weights", without_vision)
    monkeypatch.setattr(FSDPBackend, "weight_shapes", lambda self: {k: v for k, v in shapes(self).items() if ".visual." not in k})
    with pytest.raises(SyncCheckFailed, match="rollout engine 0 of 1 \\(HFRollout\\) gives the probe's tokens log-probs"):
        run(tiny_vision_model_path, data, tmp_path / "run")


def test_conversations_on_image_prompts_train_on_the_tokens_sampled_with_the_images(tiny_vision_model_path, data, tmp_path):
    """Each model turn of a conversation sees the prompt's images (the engine gets them with every
    turn's ids); every trained token is a sampled one (the loop's check) and the trainer's log-probs
    of all turns equal the engine's."""
    import feedback

    multi_turn = [
        "multi_turn.enable=true",
        "multi_turn.max_assistant_turns=2",
        "multi_turn.max_user_turns=1",
        "multi_turn.max_response_tokens=64",
        "multi_turn.interactions=[{name: again, component: count_again}]",
        "multi_turn.score=reward",  # the length reward, not the interaction's scores
        "data.max_prompt_length=64",
    ]
    plugins = load_plugins(extra=[("feedback", feedback)])
    rows = [r for r in run(tiny_vision_model_path, data, tmp_path / "run", *multi_turn, plugins=plugins) if "actor/grad_norm" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["multiturn/num_turns_mean"] > 1 and row["sync/batch_gap"] < 1e-4 and row["sync/probe_gap"] < 1e-4
    with pytest.raises(ConfigError, match="agent loop 'one_turn' takes no images .AgentLoop.takes_images., and the prompts of"):
        run(tiny_vision_model_path, data, tmp_path / "blind", *multi_turn, "multi_turn.agent_loop=one_turn", plugins=plugins)


def test_an_image_a_tool_returns_is_shown_to_the_next_turn_and_trained_token_exactly(tiny_vision_model_path, data, tmp_path):
    """verl's multimodal tool responses: each tool result's image expands to its slots after the model
    turn, the next turn is generated with the prompt's image and the tool's, and the trainer reads the
    same images in the same order (the batch check holds the log-probs of every turn to the engine's)."""
    import feedback

    tools = [
        "multi_turn.enable=true",
        "multi_turn.max_assistant_turns=2",
        "multi_turn.max_response_tokens=96",
        "multi_turn.tools=[{component: look}]",
        "multi_turn.tool_parser=always_look",
        "multi_turn.score=reward",
        "data.max_prompt_length=256",  # the tool's schema is in every prompt
    ]
    run_dir = tmp_path / "run"
    rows = [
        r for r in run(tiny_vision_model_path, data, run_dir, *tools, plugins=load_plugins(extra=[("feedback", feedback)])) if "actor/grad_norm" in r
    ]
    assert len(rows) == 2
    for row in rows:
        assert row["multiturn/num_turns_mean"] == 2 and row["multiturn/tool_calls"] == 16 * 2 and row["multiturn/tool_errors"] == 0
        assert row["sync/batch_gap"] < 1e-4 and row["sync/probe_gap"] < 1e-4
