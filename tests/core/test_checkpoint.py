"""The checkpoint module without models: atomic folders with a manifest, pruning, incomplete
checkpoints ignored, recipe state and RNG restored, changed configs refused."""

from __future__ import annotations

import functools
import hashlib
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from trellis import PromptData, RecipeConfig, TrainerConfig, hookimpl
from trellis.config import ConfigError, validate_recipe_config
from trellis.plugins import load_plugins
from trellis.runtime import checkpoint
from trellis.runtime.checkpoint import config_changes, find_resume, latest_checkpoint, read_manifest, restore, save


class FakeRole:
    """A role group whose every rank writes one file (``weights``) into its folder."""

    def __init__(self, value: float = 0.0) -> None:
        self.value = value

    def save(self, path: Path) -> None:
        path.mkdir(parents=True)
        (path / "weights").write_text(str(self.value))

    def load(self, path: Path) -> None:
        self.value = float((path / "weights").read_text())


def cfg(**trainer):
    return OmegaConf.create({"recipe": "sft", "seed": 0, "data": {"batch_samples": 4}, "trainer": {"total_steps": 10, "resume": "auto",
                             "resume_allow_changes": [], **trainer}})  # fmt: skip


def write(run_dir: Path, step: int, keep: int = 2, config=None, value: float | None = None) -> Path:
    return save(run_dir, step, config or cfg(), {"actor": FakeRole(step if value is None else value)}, {}, keep)


def test_checkpoint_folder_has_a_manifest_listing_every_file(tmp_path):
    path = write(tmp_path, 3)
    assert path == tmp_path / "checkpoint-3"
    manifest = read_manifest(path)
    assert manifest["step"] == 3 and manifest["roles"] == ["actor"] and manifest["recipe"] == "sft"
    assert set(manifest["files"]) == {"actor/weights", "trainer_state.pt", "config.yaml"}
    assert manifest["sha256"]["actor/weights"] == hashlib.sha256(b"3").hexdigest()  # what `sha256sum` prints
    assert len(manifest["config_sha256"]) == 64 and manifest["trellis_version"]
    assert OmegaConf.load(path / "config.yaml") == cfg()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-3"]  # no temporary folder left


def test_only_the_latest_checkpoints_are_kept(tmp_path):
    for step in (1, 2, 3, 4):
        write(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-4"


def test_keep_none_keeps_every_checkpoint(tmp_path):
    """``trainer.keep_checkpoints: null`` (verl's ``max_actor_ckpt_to_keep`` default) prunes nothing."""
    for step in (1, 2, 3):
        write(tmp_path, step, keep=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda p: (p / "manifest.json").unlink(), "manifest.json is missing or unreadable"),
        (lambda p: (p / "actor" / "weights").unlink(), "actor/weights is missing"),
        (lambda p: (p / "actor" / "weights").write_text("a different size"), "actor/weights has 16 bytes, the manifest says 1"),
        (lambda p: (p / "manifest.json").write_text('{"step": 4, "fi'), "manifest.json is missing or unreadable"),
    ],
    ids=["no-manifest", "missing-file", "resized-file", "torn-manifest"],
)
def test_incomplete_checkpoint_is_skipped_for_the_previous_one(tmp_path, damage, problem, caplog):
    write(tmp_path, 2)
    damage(write(tmp_path, 4))
    assert read_manifest(tmp_path / "checkpoint-4") is None
    with caplog.at_level(logging.WARNING, logger="trellis"):
        assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert f"ignoring incomplete checkpoint {tmp_path / 'checkpoint-4'}: {problem}" in caplog.text


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Damage ``path`` in place, keeping its size."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_file_changed_in_place_falls_back_to_the_previous_checkpoint_naming_it(tmp_path, caplog):
    write(tmp_path, 2, value=22.0)
    damaged = write(tmp_path, 4, value=44.0) / "actor" / "weights"
    overwrite(damaged, 0, b"9")  # "44.0" -> "94.0": same size, so complete, but not intact
    assert read_manifest(tmp_path / "checkpoint-4") is not None
    with caplog.at_level(logging.WARNING, logger="trellis"):
        assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
        assert find_resume(cfg(), tmp_path) == tmp_path / "checkpoint-2"
    assert f"checkpoint {tmp_path / 'checkpoint-4'} is damaged: {damaged} changed after it was written" in caplog.text
    assert "falling back to the previous complete checkpoint" in caplog.text
    role = FakeRole()
    restore(find_resume(cfg(), tmp_path), {"actor": role}, {})
    assert role.value == 22.0


def test_a_damaged_checkpoint_named_explicitly_or_the_only_one_is_refused_naming_the_file(tmp_path):
    path = write(tmp_path, 2)
    overwrite(path / "trainer_state.pt", 40, bytes(16))
    with pytest.raises(ConfigError, match=r"config key 'trainer.resume': checkpoint .*checkpoint-2 is damaged: .*trainer_state.pt changed"):
        find_resume(cfg(resume=str(path)), tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=r"trainer_state.pt changed .*no intact checkpoint is left in .*; start over in another trainer.run_dir"):
        find_resume(cfg(), tmp_path)


def test_a_crash_mid_save_leaves_the_previous_checkpoint_and_the_next_save_cleans_up(tmp_path):
    write(tmp_path, 2)

    class Crashing(FakeRole):
        def save(self, path):
            super().save(path)
            raise KeyboardInterrupt  # stands for a kill after this role's files

    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 4, cfg(), {"actor": Crashing(4)}, {}, 2)
    assert (tmp_path / ".checkpoint-4.tmp" / "actor" / "weights").is_file()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    write(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]


class Position:
    """State a run keeps beside its roles (a data loader's place): ``state_dict`` / ``load_state_dict``."""

    def __init__(self) -> None:
        self.batches = 0

    def next_indices(self) -> int:
        self.batches += 1
        return self.batches

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches = state["batches"]


def test_restore_brings_back_roles_loader_position_and_every_rng(tmp_path):
    loader = Position()
    for _ in range(4):
        loader.next_indices()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    save(tmp_path, 4, cfg(), {"actor": FakeRole(4.0)}, {"data": loader}, 2)
    expected = (loader.next_indices(), torch.rand(3), random.random(), np.random.rand())

    role, fresh = FakeRole(), Position()
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    assert restore(tmp_path / "checkpoint-4", {"actor": role}, {"data": fresh}) == 4
    assert role.value == 4.0
    got = (fresh.next_indices(), torch.rand(3), random.random(), np.random.rand())
    assert got[0] == expected[0] and torch.equal(got[1], expected[1]) and got[2:] == expected[2:]


def test_config_changes_ignore_pacing_keys_and_allowed_keys():
    saved = {"model": {"path": "/m"}, "actor": {"optim": {"lr": 0.001, "betas": [0.9, 0.99]}}, "trainer": {"total_steps": 4, "trackers": ["jsonl"]}}
    now = {"model": {"path": "/other"}, "actor": {"optim": {"lr": 0.01, "betas": [0.9, 0.95]}, "new": 1},
           "trainer": {"total_steps": 8, "trackers": ["console"]}}  # fmt: skip
    assert config_changes(saved, now) == [
        "actor.new: '<absent>' -> 1",
        "actor.optim.betas: [0.9, 0.99] -> [0.9, 0.95]",
        "actor.optim.lr: 0.001 -> 0.01",
        "model.path: '/m' -> '/other'",
    ]
    assert config_changes(saved, now, ["actor", "model.path"]) == []
    assert config_changes(saved, now, ["actor.optim.l"]) != config_changes(saved, now, ["actor.optim.lr"])  # whole keys only


def test_find_resume_per_trainer_resume(tmp_path):
    assert find_resume(cfg(), tmp_path) is None  # auto, nothing yet: a fresh run
    write(tmp_path, 2)
    assert find_resume(cfg(), tmp_path) == tmp_path / "checkpoint-2"
    assert find_resume(cfg(resume=str(tmp_path)), tmp_path / "elsewhere") == tmp_path / "checkpoint-2"
    with pytest.raises(ConfigError, match=r"'never', but .* already holds checkpoints of an earlier run; choose another trainer.run_dir"):
        find_resume(cfg(resume="never"), tmp_path)
    with pytest.raises(ConfigError, match=r"config key 'trainer.resume': '.*checkpoint-7' is not a complete checkpoint .*beside it: checkpoint-2"):
        find_resume(cfg(resume=str(tmp_path / "checkpoint-7")), tmp_path)
    changed = cfg()
    changed.data.batch_samples = 8
    with pytest.raises(ConfigError, match=r"data.batch_samples: 4 -> 8.*trainer.resume_allow_changes=\[data.batch_samples\]"):
        find_resume(changed, tmp_path)


@dataclass
class PromptsConfig(RecipeConfig):
    """A recipe's config of core's shared sections (prompts, a trainer)."""

    recipe: str = "prompts"
    data: PromptData = field(default_factory=PromptData)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class PromptsRecipe:
    """Registers a recipe of that config, which only its config is read of here."""

    Config = PromptsConfig

    def run(self, cfg, ctx):
        raise NotImplementedError

    @staticmethod
    @hookimpl
    def trellis_register(registry):
        registry.add("recipe", "prompts", PromptsRecipe(), options=PromptsConfig)


def test_a_checkpoint_saved_before_an_option_existed_resumes_with_the_options_default(tmp_path):
    """The saved config is read through the current schema (``read``): an option a later version
    added (here the images column) takes its default and is no change; a saved value that differs
    from it still is."""
    registry = load_plugins(extra=[("prompts", PromptsRecipe)]).registry
    # components of the example plugin (this session installs no algorithm or backend package)
    components = {"recipe": "prompts", "backend": {"name": "example_counting"}}
    given = OmegaConf.merge(cfg(), {"model": {"path": "m"}}, components)
    given.data = {"train_path": "rows.jsonl"}
    current = validate_recipe_config(given, registry)
    older = OmegaConf.create(OmegaConf.to_container(current))
    del older.data["image_key"]
    write(tmp_path, 2, config=older)
    read = functools.partial(validate_recipe_config, registry=registry)
    assert find_resume(current, tmp_path, read=read) == tmp_path / "checkpoint-2"
    with pytest.raises(ConfigError, match="data.image_key: '<absent>' -> 'images'"):
        find_resume(current, tmp_path)  # compared as written
    older.data.image_key = "pictures"
    write(tmp_path, 3, config=older)
    with pytest.raises(ConfigError, match="data.image_key: 'pictures' -> 'images'"):
        find_resume(current, tmp_path, read=read)


def test_a_run_resumed_from_an_older_checkpoint_replaces_the_newer_ones(tmp_path):
    write(tmp_path, 2, keep=3)
    write(tmp_path, 4, keep=3)
    write(tmp_path, 3, keep=3, value=33.0)  # resumed from checkpoint-2, now saving step 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-3"


def test_checkpointer_saves_when_due_and_fires_the_hook(tmp_path):
    fired = []

    class hook:
        @staticmethod
        def trellis_checkpoint_saved(step, path):
            fired.append((step, path))

    ckpt = checkpoint.Checkpointer(cfg(total_steps=5, save_every_steps=2, keep_checkpoints=5), tmp_path, None, hook)
    assert ckpt.restore({"actor": FakeRole(), "critic": None}, {"kl": None}) == 0
    for step in range(1, 6):
        ckpt.after_step(step)
    assert [s for s, _ in fired] == [2, 4, 5]  # every 2 steps and at the last
    assert fired[-1][1] == tmp_path / "checkpoint-5"
    latest = checkpoint.find_resume(cfg(total_steps=5), tmp_path)
    assert not checkpoint.Checkpointer(cfg(total_steps=5), tmp_path, latest, hook).finished  # end tasks not yet done
    ckpt.mark_finished()
    assert checkpoint.Checkpointer(cfg(total_steps=5), tmp_path, latest, hook).finished
    assert not checkpoint.Checkpointer(cfg(total_steps=6), tmp_path, latest, hook).finished


def test_export_of_a_folder_without_a_complete_checkpoint_names_what_is_there(tmp_path, capsys):
    from trellis.cli import main

    write(tmp_path, 2)
    (tmp_path / "checkpoint-4").mkdir()  # a folder with no manifest
    assert main(["export", str(tmp_path / "checkpoint-4"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "checkpoint-4' is not a complete checkpoint nor a run folder holding one; complete checkpoints beside it: checkpoint-2" in err
    assert not (tmp_path / "hf").exists()
