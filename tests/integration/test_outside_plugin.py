"""A plugin written as a third party would (tests/plugins/outside, installed, found by entry point)
trains on the tiny model with no core edit and no private name: its group filter with options and
its agent loop with an environment of its own in one rl run, and its recipe with a role, a verb and
a kind of its own."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import trellis_outside.plugin as outside
from trellis import hookimpl
from trellis.config import ConfigError
from trellis.export import export_checkpoint
from trellis.plugins import load_plugins
from trellis.recipes.train import train
from trellis.registry import RegistryError
from trellis_algos.rl.dynamic_sampling import DynamicSamplingConfig, group_filters
from trellis_demo.tasks import make_arithmetic_split, write_rows

PUBLIC = ("trellis", "trellis_algos", "trellis_multiturn")  # trellis's __all__, and other packages' top-level exports


def test_the_outside_plugin_imports_only_public_names():
    """Every import of the plugin from trellis or a trellis package is a top-level one (or a
    ``trellis.kit`` module): what docs/plugins.md calls the public API."""
    tree = ast.parse(Path(outside.__file__).read_text())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    ours = [m for m in modules if m.split(".")[0].startswith("trellis")]
    assert ours and all(m in PUBLIC or m.startswith("trellis.kit.") for m in ours), ours


def _mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of ones in a response mask."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_its_loop_and_filter_train_retold_samples_of_groups_that_spread(run_rl, tiny_model_path, step_batches):
    """``outside_retell`` asks the model to say its answer again (an environment turn, mask 0) and
    scores the retelling by the share of its tokens the first answer held; ``outside_spread`` with
    ``min_spread=0.1`` keeps only the groups whose scores differ by more (on the random tiny model
    most retellings share no token: a group of 8 spreads in about half the rounds). Each trained
    sample's reward is recomputed here from its own tokens."""
    from transformers import AutoTokenizer

    _, rows = run_rl(
        "multi_turn.enable=true", "multi_turn.agent_loop=outside_retell", "multi_turn.max_response_tokens=64",
        "algorithm.dynamic_sampling.enable=true", "algorithm.dynamic_sampling.filters=[outside_spread]",
        "algorithm.dynamic_sampling.filter_options={outside_spread: {min_spread: 0.1}}", "sampling.n=8",
    )  # fmt: skip
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(step_batches) == len(steps) == 2
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for row, batch in zip(steps, step_batches):
        assert row["multiturn/num_turns_mean"] == 2.0 and row["multiturn/user_turns_mean"] == 1.0 and row["multiturn/finish_retold"] == 1.0
        assert row["dynamic_sampling/kept_groups"] == 4.0 and len(batch) == 32
        scores = batch["token_scores"].sum(-1)
        for i in range(len(batch)):
            mask, ids = batch["response_mask"][i].tolist(), batch["responses"][i].tolist()
            (a, b), (c, d) = _mask_runs(mask)  # the two model turns, the environment's between them
            assert "Say that again." in tokenizer.decode(ids[b:c])
            first, again = ids[a:b], ids[c:d]
            assert scores[i].item() == pytest.approx(sum(t in set(first) for t in again) / len(again))
        for group in batch.group_index("uid").unique():
            mine = scores[batch.group_index("uid") == group]
            assert mine.max() - mine.min() > 0.1
    assert sum(r["dynamic_sampling/dropped_groups"] for r in steps) > 0  # the option bit: equal groups were refilled


def test_its_filter_gets_the_options_the_config_gives_it():
    """Spreads 0.3 and 1.0: ``min_spread=0.5`` keeps the second group only, the default (0) both."""
    registry = load_plugins().registry
    values, groups = torch.tensor([0.0, 0.3, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])
    for options, kept in (({"outside_spread": {"min_spread": 0.5}}, [False, True]), ({}, [True, True])):
        (keep,) = group_filters(DynamicSamplingConfig(True, filters=["outside_spread"], filter_options=options), registry)
        assert keep(values, groups).tolist() == kept


def test_its_loop_refuses_settings_it_cannot_run_with_before_any_model_is_built(run_rl):
    with pytest.raises(ConfigError, match="multi_turn.max_assistant_turns' is 1; the outside_retell loop takes two model turns"):
        run_rl("multi_turn.enable=true", "multi_turn.agent_loop=outside_retell", "multi_turn.max_assistant_turns=1")


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_its_recipe_trains_the_actor_against_a_teacher_role(tiny_model_path, tiny_untied_model_path, tmp_path):
    """A teacher from another model folder (another random init), a verb ``distill`` and a kind
    ``teacher_loss`` that core never names: the student's squared log-prob gap to the teacher
    on its own samples falls, and the teacher gets no training verb (no optimizer)."""
    data = write_rows(make_arithmetic_split(64, 0, max_value=50), tmp_path / "train.parquet")
    plugins = load_plugins()
    assert plugins.registry.get("teacher_loss", "k2").plugin == "outside"
    summary = train(
        None,
        [
            "recipe=teacher_distill",
            f"model.path={tiny_model_path}",
            f"teacher_path={tiny_untied_model_path}",
            f"data.train_path={data}",
            "data.train_batch_prompts=16",
            "sampling.n=4",
            "sampling.max_new_tokens=6",
            "train.optim.lr=3e-3",
            "trainer.total_steps=12",
            "trainer.trackers=[jsonl]",
            f"trainer.run_dir={tmp_path / 'distill'}",
        ],
        plugins=plugins,
    )
    losses = [r["distill/loss"] for r in _rows(tmp_path / "distill") if "distill/loss" in r]
    assert len(losses) == 12 and losses[0] > 0
    assert sum(losses[-3:]) < 0.75 * sum(losses[:3]), losses  # measured: 0.0141 -> 0.0079 (3-step means)
    assert "distill" in summary["student_routes"] and "distill" not in summary["teacher_routes"]
    # the recipe declares what `trellis export` writes of its checkpoints: the student, as a model folder
    out = export_checkpoint(tmp_path / "distill", tmp_path / "student-hf", plugins=plugins)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_a_kind_another_plugin_already_adds_is_refused_naming_both():
    class Twice:
        @hookimpl
        def trellis_add_kinds(self, registry):
            registry.add_kind("teacher_loss")

    with pytest.raises(RegistryError, match="adds kind 'teacher_loss', which 'outside' already defines"):
        load_plugins(extra=[("again", Twice())])
