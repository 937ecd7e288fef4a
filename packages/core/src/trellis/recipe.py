"""What a recipe (kind ``recipe``) receives, and how ``trellis train`` starts one."""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from trellis import config as config_mod
from trellis.checkpoint import checkpoint_step, find_resume
from trellis.plugins import Plugins, load_plugins

log = logging.getLogger("trellis")


@dataclass
class RunContext:
    """The loaded plugins (registry and lifecycle hooks) and the run folder."""

    plugins: Plugins
    run_dir: Path

    @property
    def registry(self):
        return self.plugins.registry

    @property
    def hook(self):
        return self.plugins.hook


class Recipe:
    """A training program. ``Config`` is its config dataclass; ``run`` executes it."""

    Config: type

    def run(self, cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
        """Run to the end; return the final summary figures."""
        raise NotImplementedError


def run_dir_for(cfg: DictConfig) -> Path:
    """``trainer.run_dir``; else the run folder of the checkpoint ``trainer.resume`` names; else a new
    ``runs/<recipe>-<time>``."""
    trainer = cfg.get("trainer") or {}
    run_dir = trainer.get("run_dir") if hasattr(trainer, "get") else None
    if run_dir:
        return Path(run_dir)
    resume = trainer.get("resume") if hasattr(trainer, "get") else None
    if resume not in (None, "auto", "never"):
        path = Path(resume)
        return path.parent if checkpoint_step(path) is not None else path
    return Path("runs") / f"{cfg.recipe}-{dt.datetime.now():%Y%m%d-%H%M%S}"


def train(config_path: str | None, overrides: list[str], plugins: Plugins | None = None) -> dict[str, Any]:
    """Compose and check the config (and the checkpoint to resume from) before any model is built,
    save it, run the recipe."""
    plugins = plugins or load_plugins()
    if not plugins.registry.names("recipe"):
        raise config_mod.ConfigError(
            "no recipe is installed; the rl and sft recipes come with trellis-core, SPIN with trellis-algos"
        )
    cfg = config_mod.compose(config_path, overrides, plugins.registry)
    recipe = plugins.registry.get("recipe", cfg.recipe).obj
    run_dir = run_dir_for(cfg)
    if "resume" in (cfg.get("trainer") or {}):
        find_resume(cfg, run_dir)  # a refused resume leaves the run folder as it was
    config_mod.save(cfg, run_dir / "config.yaml")
    log.info("run folder: %s", run_dir)
    return recipe.run(cfg, RunContext(plugins, run_dir))
