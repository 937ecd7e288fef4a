"""What a recipe (kind ``recipe``) is, and how ``trellis train`` starts one."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import importlib
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig

from trellis import config as config_mod
from trellis.interfaces.backend import Backend
from trellis.interfaces.hf import linear_layers
from trellis.plugins import Plugins, load_plugins
from trellis.registry import Entry, Registry
from trellis.runtime.checkpoint import checkpoint_step, find_resume, read_manifest
from trellis.runtime.harness import RunContext, make_threads
from trellis.runtime.threads import parse_threads
from trellis.runtime.trackers import Trackers

log = logging.getLogger("trellis")


class Recipe(Protocol):
    """A training program, registered with ``registry.add("recipe", name, obj, options=obj.Config)``.

    Config: its config dataclass. run: execute it (with a ``trellis.runtime.harness.Run``).
    Optional: ``evaluate(cfg, ctx) -> dict`` runs the recipe's validation alone, once, on
    ``model.path`` (``trellis eval``); ``check(cfg, registry)`` raises ``ConfigError`` for what a user can fix, before
    anything is written or built; ``check_data(cfg, registry) -> str`` reads the data files with
    the tokenizer (columns, prompt lengths; no model) for ``trellis train --dry-run`` and returns a
    one-line summary; ``resume_safe_keys``: config keys (beyond the trainer's pacing keys) that may
    change between a checkpoint and the run resuming it; ``policy``: the config section the
    ``actor`` role (the policy) is built from (its adapter reaches the engine); ``exports``: the
    roles ``trellis export`` writes from a checkpoint, each with its head (``lm``, ``reward``), the
    first the checkpoint holds. The registry reads them once, when the recipe registers
    (``trellis.registry.INTERFACES``, ``Entry.declared``), and refuses a name a typo away from one
    of them.
    """

    Config: type

    def run(self, cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
        """Run to the end; return the final summary figures."""


class Interrupted(Exception):
    """Ctrl-C stopped the run in ``run_dir`` (``args[0]``); ``trainer.resume=auto`` continues it."""

    @property
    def run_dir(self) -> Path:
        return self.args[0]


@contextlib.contextmanager
def interrupts_named(run_dir: Path) -> Iterator[None]:
    """Turn Ctrl-C into ``Interrupted(run_dir)``, also when a library wraps the ``KeyboardInterrupt``
    in its own error (torch's distributed checkpoint does): any error after a SIGINT counts."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):  # signals go to the main thread
        yield
        return
    seen: list[int] = []

    def note(signum: int, frame: Any) -> None:
        seen.append(signum)
        previous(signum, frame)

    signal.signal(signal.SIGINT, note)
    try:
        yield
    except BaseException:
        if seen:
            raise Interrupted(run_dir) from None
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


def warn_failed_plugins(plugins: Plugins) -> None:
    """One line per installed plugin that failed to load: what it registers is missing from this run."""
    for info in plugins.infos:
        if info.error:
            what = f"plugin {info.name!r} ({info.distribution} {info.version})"
            log.warning("%s failed to load, so nothing it registers is available: %s", what, info.error)


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


def check(recipe: Entry, cfg: DictConfig, registry: Registry, run_dir: Path) -> Path | None:
    """Everything that needs no model: ``trainer.threads``, the trackers ``trainer.trackers`` names
    (installed, their library imports), the recipe's own checks, the LoRA adapters, then the
    checkpoint to resume from (checked against the config). Returns that checkpoint, or None for a
    fresh run."""
    if "threads" in (cfg.get("trainer") or {}):
        make_threads(registry, cfg.trainer)
    if "trackers" in (cfg.get("trainer") or {}):
        Trackers.check(cfg.trainer.trackers, registry)
    if recipe.declared["check"] is not None:
        recipe.declared["check"](cfg, registry)  # model.path exists and is a model folder: the adapters' check reads it
    check_adapters(cfg, registry)
    if "resume" not in (cfg.get("trainer") or {}):
        return None
    read = functools.partial(config_mod.validate_recipe_config, registry=registry)
    return find_resume(cfg, run_dir, tuple(recipe.declared["resume_safe_keys"]), read)


def check_adapters(cfg: DictConfig, registry: Registry) -> None:
    """Each role section with a LoRA adapter (``adapter.rank`` > 0): the backend trains adapters,
    the library they need imports (a missing peft passed the dry run, then stopped the run with a
    traceback) and each of its ``target_modules`` names linear layers of ``model.path``. A backend
    registered as a factory rather than a class is checked when it is built."""
    backend = registry.get("backend", cfg.backend.name).obj if "backend" in cfg else None
    if not (isinstance(backend, type) and issubclass(backend, Backend)):
        return
    for key, section in cfg.items():
        rank = section.adapter.rank if isinstance(section, DictConfig) and "adapter" in section else 0
        if not rank:
            continue
        if not backend.adapters:
            raise config_mod.ConfigError(
                f"config key '{key}.adapter.rank'={rank}: backend {cfg.backend.name!r} trains full weights only; "
                "set it to 0, or use backend.name=fsdp"
            )
        if backend.adapter_requires is not None:
            module, requirement = backend.adapter_requires
            try:
                importlib.import_module(module)
            except ImportError:
                needs = f"config key '{key}.adapter.rank'={rank} needs {module}"
                raise config_mod.ConfigError(f"{needs}: pip install '{requirement}', or set it to 0") from None
        check_target_modules(f"{key}.adapter.target_modules", list(section.adapter.target_modules), cfg.model.path)


def check_target_modules(key: str, targets: list[str], model_path: str) -> None:
    """Every name of ``targets`` (``[all-linear]``, or module-name suffixes) names linear layers of
    the model in ``model_path``, built from its config alone: a name that matched no layer stopped
    the run at build with a traceback, or, beside names that matched, was silently ignored."""
    if targets == ["all-linear"]:
        return
    layers = linear_layers(model_path)
    unmatched = [t for t in targets if not any(name == t or name.endswith("." + t) for name in layers)]
    if unmatched:
        names = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in layers}))
        raise config_mod.ConfigError(
            f"config key '{key}'={targets}: the model in model.path {model_path!r} has no linear layer named "
            f"{', '.join(map(repr, unmatched))}; its linear layers are named {names}: choose among them, or use [all-linear]"
        )


def keep_recorded_threads(cfg: DictConfig, resume_from: Path) -> None:
    """Under ``trainer.threads=auto`` a resumed run takes the thread count its checkpoint was written
    with, not the one the load now suggests: the count can change torch's arithmetic, and a resumed
    run must equal an uninterrupted one."""
    recorded = (read_manifest(resume_from) or {}).get("torch_threads")
    if recorded and parse_threads(cfg.trainer.threads) == "auto":
        log.info("threads: %d, as %s recorded (trainer.threads=auto keeps one count for the whole run)", recorded, resume_from)
        cfg.trainer.threads = str(recorded)


def train(config_path: str | None, overrides: list[str], plugins: Plugins | None = None, dry_run: bool = False) -> dict[str, Any]:
    """Compose and check the config (and the checkpoint to resume from) before anything is written
    or built, run the recipe (the run harness saves the config in the run folder when the run
    starts). ``dry_run``: only the checks that need no model, the data read with the tokenizer
    included; returns what they found and writes nothing."""
    plugins = plugins or load_plugins()
    warn_failed_plugins(plugins)
    if not plugins.registry.names("recipe"):
        raise config_mod.ConfigError("no recipe is installed; the rl and sft recipes come with trellis-core: pip install trellis-core")
    cfg = config_mod.compose(config_path, overrides, plugins.registry)
    recipe = plugins.registry.get("recipe", cfg.recipe)
    run_dir = run_dir_for(cfg)
    resume_from = check(recipe, cfg, plugins.registry, run_dir)  # a refused run leaves the run folder as it was
    if dry_run:
        check_data = recipe.declared["check_data"]
        data = check_data(cfg, plugins.registry) if check_data is not None else "not checked (the recipe has no check_data)"
        return {"recipe": cfg.recipe, "run_dir": str(run_dir), "resume_from": str(resume_from) if resume_from else None, "data": data}
    if resume_from is not None:
        keep_recorded_threads(cfg, resume_from)
    ctx = RunContext(plugins, run_dir, resume_from, config=cfg)
    with interrupts_named(run_dir):
        summary = recipe.obj.run(cfg, ctx)
    ctx.write_config()  # for recipes that do not use the run harness
    return summary


def evaluate(config_path: str | None, overrides: list[str], plugins: Plugins | None = None) -> dict[str, Any]:
    """``trellis eval``: the config checked as for training, then the recipe's validation alone,
    once, on ``model.path``'s weights; nothing is trained or written. Returns its figures."""
    plugins = plugins or load_plugins()
    warn_failed_plugins(plugins)
    cfg = config_mod.compose(config_path, overrides, plugins.registry)
    declared = plugins.registry.get("recipe", cfg.recipe).declared
    if declared["evaluate"] is None:
        raise config_mod.ConfigError(f"config key 'recipe': recipe {cfg.recipe!r} has no validation to run; trellis eval runs the rl recipe's")
    if declared["check"] is not None:
        declared["check"](cfg, plugins.registry)
    return declared["evaluate"](cfg, RunContext(plugins, run_dir_for(cfg), config=cfg))
