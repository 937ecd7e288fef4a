"""Checkpoints of a run, ``<run_dir>/checkpoint-<step>/``, written atomically, and resuming from them.

A checkpoint holds one folder per trainable role (whatever the backend's ``save`` writes: each
rank its own shard), ``trainer_state.pt`` (the step, the state of the recipe's stateful objects
such as the data loader and the KL controller, and this process's RNG states), the resolved
``config.yaml`` and, written last, ``manifest.json`` (step, every file with its size and SHA-256,
a hash of the config, the Trellis version, torch's thread count). It is written to ``.checkpoint-<step>.tmp`` and
renamed only when complete, so a crash mid-save leaves the previous checkpoints as they were. A
checkpoint is *complete* when its manifest parses and every file it lists is there with its size,
and *intact* when every file also has its recorded SHA-256; a run resumes from the latest intact one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from trellis.config import ConfigError
from trellis.rng import get_rng_state, set_rng_state

log = logging.getLogger("trellis")

PREFIX = "checkpoint-"
MANIFEST = "manifest.json"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
ADAPTER_BASE_FILE = "base_model.json"  # in an adapter role's folder: the base_fingerprint of the model it was trained on

# Keys of the trainer section that change how a run is watched, paced, saved or placed, not what it
# computes: they may differ between a checkpoint's config and the resuming run's. A recipe adds its
# own (``resume_safe_keys``, e.g. held-out data). Any other difference (model, data, batch sizes,
# algorithm, optimizer, seed...) stops the resume unless trainer.resume_allow_changes names it. A
# prefix covers the keys under it.
RESUME_SAFE_KEYS = (
    "trainer.run_dir",
    "trainer.total_steps",
    "trainer.trackers",
    "trainer.val_every_steps",
    "trainer.threads",
    "trainer.save_every_steps",
    "trainer.keep_checkpoints",
    "trainer.resume",
    "trainer.resume_allow_changes",
    "trainer.save_hf_model",
    "trainer.controller",
    "trainer.nnodes",
    "trainer.procs_per_node",
    "trainer.separate_pools",
    "trainer.ray_timeout_s",
    "trainer.ray_call_timeout_s",
)


# -- finding checkpoints ----------------------------------------------------------------------------
def checkpoint_step(path: Path) -> int | None:
    """The step in a ``checkpoint-<step>`` folder name, else None."""
    name = Path(path).name
    if not name.startswith(PREFIX) or not name[len(PREFIX) :].isdigit():
        return None
    return int(name[len(PREFIX) :])


def _inspect(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) for a complete checkpoint, else (None, what is wrong)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        files, sums = manifest["files"], manifest["sha256"]
        if set(files) != set(sums):
            raise KeyError("sha256")
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"{MANIFEST} is missing or unreadable"
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            return None, f"{rel} is missing"
        if f.stat().st_size != size:
            return None, f"{rel} has {f.stat().st_size} bytes, the manifest says {size}"
    return manifest, None


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a complete checkpoint; None when the manifest is missing or unreadable, or
    a file it lists is missing or has another size."""
    return _inspect(Path(path))[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def checksums(path: Path, files: list[str]) -> dict[str, str]:
    """The SHA-256 of each of ``files`` (relative to ``path``), read in parallel."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
        return dict(zip(files, pool.map(lambda rel: _sha256(Path(path) / rel), files)))


def damaged_files(path: Path) -> list[str]:
    """The files of the complete checkpoint ``path`` whose content is not what was written (their
    SHA-256 differs from the manifest's): a corruption that kept the size."""
    manifest = read_manifest(path)
    return [rel for rel, digest in checksums(path, sorted(manifest["files"])).items() if digest != manifest["sha256"][rel]]


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints in ``run_dir``, oldest step first; each incomplete one is skipped
    with a warning saying what is wrong with it."""
    run_dir = Path(run_dir)
    found = [p for p in run_dir.glob(f"{PREFIX}*") if p.is_dir() and checkpoint_step(p) is not None] if run_dir.is_dir() else []
    complete = []
    for p in sorted(found, key=checkpoint_step):
        problem = _inspect(p)[1]
        if problem:
            log.warning("ignoring incomplete checkpoint %s: %s", p, problem)
        else:
            complete.append(p)
    return complete


def _damage_warning(path: Path, damaged: list[str]) -> str:
    return (
        f"checkpoint {path} is damaged: {', '.join(str(path / rel) for rel in damaged)} changed after it was written "
        "(its SHA-256 differs from the manifest's)"
    )


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The intact checkpoint with the highest step in ``run_dir``, or None when there is no complete
    one. A damaged newer checkpoint is skipped with a warning naming its files; when every complete
    one is damaged, ``ConfigError`` says so."""
    found = complete_checkpoints(run_dir)
    for newer, path in enumerate(reversed(found)):
        damaged = damaged_files(path)
        if not damaged:
            return path
        if newer + 1 < len(found):
            log.warning("%s; falling back to the previous complete checkpoint", _damage_warning(path, damaged))
        else:
            raise ConfigError(
                f"{_damage_warning(path, damaged)}, and no intact checkpoint is left in {run_dir}; start over in another trainer.run_dir"
            )
    return None


def resolve_checkpoint(where: str | Path) -> Path:
    """A checkpoint folder as given, or the latest intact one when ``where`` is a run folder;
    raises ``FileNotFoundError`` saying what is there when neither is complete, ``ConfigError``
    when the checkpoint given is damaged."""
    where = Path(where)
    given = checkpoint_step(where) is not None or (where / MANIFEST).exists()
    path = where if given else latest_checkpoint(where)
    if path is None or read_manifest(path) is None:
        there = [p.name for p in complete_checkpoints(where.parent if checkpoint_step(where) is not None else where)]
        raise FileNotFoundError(
            f"{str(where)!r} is not a complete checkpoint nor a run folder holding one"
            + (f"; complete checkpoints beside it: {', '.join(there)}" if there else "")
        )
    if given and (damaged := damaged_files(path)):
        raise ConfigError(f"{_damage_warning(path, damaged)}; give an earlier checkpoint or the run folder")
    return path


# -- resuming ---------------------------------------------------------------------------------------
def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> leaf value of a config (lists are leaves)."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): node}


def _covered(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def config_changes(saved: Any, current: Any, allowed: list[str] | tuple[str, ...] = ()) -> list[str]:
    """``key: saved -> current`` for every key whose value changed the meaning of the run: neither
    in :data:`RESUME_SAFE_KEYS` nor in ``allowed`` (the recipe's safe keys and the user's)."""
    old, new = flatten(saved), flatten(current)
    missing = "<absent>"
    return [
        f"{key}: {old.get(key, missing)!r} -> {new.get(key, missing)!r}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key, missing) != new.get(key, missing) and not _covered(key, RESUME_SAFE_KEYS) and not _covered(key, allowed)
    ]


def base_fingerprint(model_path: str | Path) -> dict[str, str]:
    """The base model a LoRA adapter is trained on: its folder and the SHA-256 of its weight files
    (``*.safetensors``, ``*.bin``, in name order). A backend saving an adapter role writes it to
    :data:`ADAPTER_BASE_FILE` in the role's folder; a resume or export checks it before building
    anything (:func:`adapter_base_mismatch`). The weights are read once per process while their
    files keep their sizes and modification times (a resume's check, then the first save)."""
    files = sorted(p for p in Path(model_path).iterdir() if p.suffix in (".safetensors", ".bin"))
    stamps = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return {"path": str(model_path), "sha256": _weights_sha256(str(model_path), stamps)}


@functools.lru_cache(maxsize=8)
def _weights_sha256(model_path: str, stamps: tuple[tuple[str, int, int], ...]) -> str:
    """The SHA-256 of the weight files ``stamps`` names (name, size, mtime) in ``model_path``."""
    digest = hashlib.sha256()
    for name, _, _ in stamps:
        digest.update(name.encode())
        with (Path(model_path) / name).open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def adapter_base_mismatch(path: Path, model_path: str) -> str | None:
    """How an adapter of checkpoint ``path`` (a role folder with :data:`ADAPTER_BASE_FILE`) was
    trained on other weights than ``model_path`` holds, naming both; None when every one fits."""
    current = None
    for recorded in sorted(path.glob(f"*/{ADAPTER_BASE_FILE}")):
        trained_on = json.loads(recorded.read_text())
        current = current or base_fingerprint(model_path)
        if current["sha256"] != trained_on["sha256"]:
            return (
                f"the adapter in {recorded.parent} was trained on the base model {trained_on['path']!r} (weights sha256 "
                f"{trained_on['sha256'][:12]}...), but {model_path!r} holds other weights (sha256 {current['sha256'][:12]}...)"
            )
    return None


def find_resume(
    cfg: DictConfig, run_dir: Path, safe_keys: tuple[str, ...] = (), read: Callable[[DictConfig], DictConfig] | None = None
) -> Path | None:
    """The checkpoint to resume from per ``trainer.resume`` (``auto``: the latest intact one in
    ``run_dir``, if any; ``never``; or a checkpoint or run folder), checked against ``cfg`` (its
    adapters' base model against ``model.path``, then the config); ``safe_keys``: the recipe's
    keys that may differ. ``read``: the saved config as the current schema reads it (the options a
    later version added get their defaults: a run saved before them resumes as it ran), when it can."""
    resume = str(cfg.trainer.resume)
    if resume == "never":
        if complete_checkpoints(run_dir):
            raise ConfigError(
                f"config key 'trainer.resume' is 'never', but {run_dir} already holds checkpoints of an earlier run; "
                "choose another trainer.run_dir, delete them, or resume with trainer.resume=auto"
            )
        return None
    if resume == "auto":
        path = latest_checkpoint(run_dir)
        if path is None:
            return None
    else:
        try:
            path = resolve_checkpoint(resume)
        except FileNotFoundError as exc:
            raise ConfigError(f"config key 'trainer.resume': {exc}; give a checkpoint-<step> folder, a run folder, auto or never") from None
        except ConfigError as exc:
            raise ConfigError(f"config key 'trainer.resume': {exc}") from None
    mismatch = adapter_base_mismatch(path, cfg.model.path) if "model" in cfg else None  # a recipe's adapters train on model.path
    if mismatch:
        raise ConfigError(
            f"config key 'model.path'={cfg.model.path!r}: {mismatch}; an adapter fits only its own base: set model.path to that "
            "model, or start a new run (another trainer.run_dir)"
        )
    saved = OmegaConf.load(path / CONFIG_FILE)
    with contextlib.suppress(ConfigError):  # a saved config the current schema refuses is compared as written
        saved = read(saved) if read is not None else saved
    changes = config_changes(saved, cfg, [*safe_keys, *cfg.trainer.resume_allow_changes])
    if changes:
        keys = ",".join(c.split(":", 1)[0] for c in changes)
        raise ConfigError(
            f"config key 'trainer.resume': the config differs from that of {path} in keys that change the run: "
            + "; ".join(changes)
            + f". Resume with the saved values, start a new run (another trainer.run_dir, or trainer.resume=never there), "
            f"or allow the changes: trainer.resume_allow_changes=[{keys}]"
        )
    return path


def restore(path: Path, roles: Mapping[str, Any], state: Mapping[str, Any]) -> int:
    """Load ``path`` into each role (``group.load``) and each stateful object
    (``load_state_dict``), then restore the RNG states; returns the checkpoint's step."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        raise FileNotFoundError(f"{path} is not a complete checkpoint (manifest missing, or files missing)")
    for role, group in roles.items():
        if role not in manifest["roles"]:
            raise ConfigError(f"checkpoint {path} holds no state for role {role!r} (it has: {', '.join(manifest['roles'])})")
        group.load(path / role)
    blob = torch.load(path / STATE_FILE, weights_only=True)
    for name, obj in state.items():
        if name in blob["state"]:
            obj.load_state_dict(blob["state"][name])
        else:
            log.info("checkpoint %s keeps no state of %r (an older trellis wrote it): it starts afresh", path, name)
    set_rng_state(blob["rng"])
    return int(manifest["step"])


# -- saving -----------------------------------------------------------------------------------------
def save(run_dir: Path, step: int, cfg: DictConfig, roles: Mapping[str, Any], state: Mapping[str, Any], keep: int | None) -> Path:
    """Write ``<run_dir>/checkpoint-<step>`` atomically, then keep only the latest ``keep`` (None: all)."""
    from trellis import __version__

    run_dir = Path(run_dir).absolute()  # the ranks of a role may run in other processes, with another working folder
    _remove_leftovers(run_dir)
    final = run_dir / f"{PREFIX}{step}"
    tmp = run_dir / f".{PREFIX}{step}.tmp"
    tmp.mkdir(parents=True)
    blob = {"step": step, "state": {name: obj.state_dict() for name, obj in state.items()}, "rng": get_rng_state()}
    for role, group in roles.items():
        group.save(tmp / role)
    torch.save(blob, tmp / STATE_FILE)
    config_text = OmegaConf.to_yaml(cfg, resolve=True)
    (tmp / CONFIG_FILE).write_text(config_text, encoding="utf-8")
    files = {}
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync(f)
        files[str(f.relative_to(tmp))] = f.stat().st_size
    manifest = {
        "step": step,
        "recipe": cfg.get("recipe"),
        "roles": sorted(roles),
        "files": files,
        "sha256": checksums(tmp, list(files)),
        "config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
        "trellis_version": __version__,
        "torch_threads": torch.get_num_threads(),  # a resumed run under trainer.threads=auto keeps it
        "cwd": os.getcwd(),  # what the config's relative paths (model.path: tiny) are relative to
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    _fsync(tmp / MANIFEST)
    for old in [p for p in run_dir.glob(f"{PREFIX}*") if p.is_dir() and (checkpoint_step(p) or -1) >= step]:
        # a checkpoint at or after this step is from a timeline this run rolled back from
        log.warning("replacing %s: this run resumed from an earlier step", old)
        _delete(old)
    tmp.rename(final)
    _fsync(run_dir)
    _prune(run_dir, keep)
    return final


def _prune(run_dir: Path, keep: int | None) -> None:
    if keep is None:
        return
    found = sorted((p for p in run_dir.glob(f"{PREFIX}*") if p.is_dir() and checkpoint_step(p) is not None), key=checkpoint_step)
    for old in found[: max(len(found) - keep, 0)]:
        _delete(old)


def _delete(path: Path) -> None:
    """Rename first (one atomic step), then remove: a kill never leaves half a checkpoint under its name."""
    doomed = path.with_name(f".{path.name}.deleting")
    if doomed.exists():
        shutil.rmtree(doomed)
    path.rename(doomed)
    shutil.rmtree(doomed)


def _remove_leftovers(run_dir: Path) -> None:
    """Temporary and half-deleted folders that a killed run left behind."""
    if run_dir.is_dir():
        for p in list(run_dir.glob(f".{PREFIX}*.tmp")) + list(run_dir.glob(f".{PREFIX}*.deleting")):
            shutil.rmtree(p, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


FINISHED = "finished.json"  # in the run folder: the step whose end tasks (final validation, export) are done


def finished_step(run_dir: Path) -> int | None:
    """The step at which the run in ``run_dir`` last finished, end tasks included; None if never."""
    try:
        return int(json.loads((Path(run_dir) / FINISHED).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# -- the recipe's view ------------------------------------------------------------------------------
class Checkpointer:
    """A recipe's checkpoints: restoring from ``resume_from`` (found and checked by ``train`` before
    any model is built), and saving every ``trainer.save_every_steps`` steps and at the last step."""

    def __init__(self, cfg: DictConfig, run_dir: Path, resume_from: Path | None, hook: Any) -> None:
        self.cfg, self.run_dir, self.hook = cfg, Path(run_dir), hook
        self.resume_from = resume_from
        self.start_step = read_manifest(resume_from)["step"] if resume_from else 0
        self.roles: dict[str, Any] = {}
        self.state: dict[str, Any] = {}
        total = cfg.trainer.total_steps
        if self.finished:
            log.info(
                "run already finished: %s is at step %d of trainer.total_steps=%d; nothing to do "
                "(raise trainer.total_steps to train on, or use another trainer.run_dir to start over)",
                self.resume_from, self.start_step, total,
            )  # fmt: skip

    @property
    def finished(self) -> bool:
        """The checkpoint to resume from is at (or past) the last step and the run's end tasks ran
        after it (a run killed between its last checkpoint and the end resumes to do them)."""
        at_end = self.resume_from is not None and self.start_step >= self.cfg.trainer.total_steps
        return at_end and finished_step(self.run_dir) == self.start_step

    def mark_finished(self) -> None:
        """Record that the run reached ``trainer.total_steps`` with its end tasks done."""
        (self.run_dir / FINISHED).write_text(json.dumps({"step": self.cfg.trainer.total_steps}))

    def restore(self, roles: Mapping[str, Any], state: Mapping[str, Any]) -> int:
        """Remember what to save (``None`` entries are skipped) and, when resuming, load it all;
        returns the step the run resumes after (0 for a fresh run)."""
        self.roles = {k: v for k, v in roles.items() if v is not None}
        self.state = {k: v for k, v in state.items() if v is not None}
        _remove_leftovers(self.run_dir)  # a kill while the last checkpoint was pruned left one that no later save removes
        if self.resume_from is not None:
            restore(self.resume_from, self.roles, self.state)
            total = self.cfg.trainer.total_steps
            if self.start_step >= total:
                log.info("resumed from %s, the last step: its end tasks (final validation, export) did not finish; running them", self.resume_from)
            else:
                log.info("resumed from %s: next step %d of %d", self.resume_from, self.start_step + 1, total)
        return self.start_step

    def after_step(self, step: int) -> Path | None:
        """Save when ``step`` is due; fire ``trellis_checkpoint_saved``."""
        t = self.cfg.trainer
        due = step == t.total_steps or (t.save_every_steps > 0 and step % t.save_every_steps == 0)
        if not due or t.keep_checkpoints == 0:
            return None
        path = save(self.run_dir, step, self.cfg, self.roles, self.state, t.keep_checkpoints)
        self.hook.trellis_checkpoint_saved(step=step, path=path)
        return path
