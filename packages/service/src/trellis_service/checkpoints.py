"""``tinker://`` paths and the folders under the server's ``--root`` they name: immutable once written."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from trellis_service.errors import UserError

KINDS = {"weights": "training state", "sampler_weights": "sampler weights"}
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
PATH = re.compile(r"^tinker://([^/]+)/(weights|sampler_weights)/([^/]+)$")
EXPIRES = "expires_at"  # in a checkpoint saved with ttl_seconds: when the server removes it (seconds since the epoch)


def run_folder(model_id: str) -> str:
    """A training run's folder name (model ids hold ``:``, which some file systems refuse)."""
    return model_id.replace(":", "__")


class Checkpoints:
    """Where each ``tinker://<model_id>/<kind>/<name>`` lives: ``<root>/<model_id>/<kind>/<name>``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def new(self, model_id: str, kind: str, name: str, overwrite: bool = False) -> tuple[str, Path]:
        """The path and folder for a checkpoint about to be written; an existing one is refused
        (checkpoints are immutable) unless ``overwrite``, which removes it first."""
        if not NAME.match(name or ""):
            raise UserError(f"checkpoint name {name!r} must be letters, digits, '.', '_' or '-' (not starting with '.' or '-')")
        folder = self.root / run_folder(model_id) / kind / name
        if folder.exists():
            if not overwrite:
                raise UserError(
                    f"checkpoint tinker://{model_id}/{kind}/{name} exists and checkpoints are immutable; choose another name or pass overwrite=True"
                )
            shutil.rmtree(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        return f"tinker://{model_id}/{kind}/{name}", folder

    def find(self, path: str, kind: str) -> tuple[str, Path]:
        """The model id and folder of an existing ``tinker://`` path of ``kind``."""
        match = PATH.match(path or "")
        if not match:
            raise UserError(f"path {path!r} is not a tinker:// path this server wrote (tinker://<model_id>/{kind}/<name>)")
        model_id, found, name = match.groups()
        if found != kind:
            raise UserError(f"path {path!r} names {KINDS[found]}, here {KINDS[kind]} are needed (tinker://<model_id>/{kind}/<name>)")
        folder = self.root / run_folder(model_id) / kind / name
        if not folder.is_dir():
            raise UserError(f"path {path!r} does not exist on this server (no {folder})")
        return model_id, folder

    def keep_for(self, folder: Path, ttl_seconds: int | None) -> None:
        """A checkpoint just written at ``folder`` lives ``ttl_seconds`` (None: until deleted)."""
        if ttl_seconds is not None:
            (folder / EXPIRES).write_text(f"{time.time() + ttl_seconds:.0f}\n")

    def sweep(self, now: float | None = None) -> list[Path]:
        """Remove the checkpoints whose time to live has passed; returns their folders."""
        now = time.time() if now is None else now
        expired = [f.parent for f in self.root.glob(f"*/*/*/{EXPIRES}") if float(f.read_text()) <= now]
        for folder in expired:
            shutil.rmtree(folder)
        return expired
