"""verl's resolved config beside the converted one, setting by setting: every key of the config
verl itself would run (its installed ``_generated_ppo_trainer.yaml``, the entry point's config and
the launch's settings) is SAME (converted, or what trellis does anyway), DIFF (converted, the run
differing as stated), NOT CONVERTED (with the reason) or SILENT (none of those: a defect)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from trellis import DataError
from trellis_verl_compat.launch import ENTRIES, compose, entry_of
from trellis_verl_compat.rule import set_dotted
from trellis_verl_compat.sft import SFT_GROUPS

GENERIC = "no trellis counterpart"


def verl_config_dir() -> Path:
    """The installed verl package's folder (verl itself is not imported)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the parity table reads verl's own config: pip install --no-deps verl==0.9.1")
    return Path(next(iter(spec.submodule_search_locations)))


def verl_base(entry: str, choices: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The mappings verl merges before the user's for ``entry``: its generated PPO config, then the
    entry's own config file (its keys above ppo_trainer), where verl ships it; for verl's SFT trainer,
    its config's groups (``choices`` overriding the default options) and then the config itself."""
    root = verl_config_dir()
    if entry_of(entry).recipe == "sft":
        return sft_base(root / "trainer" / "config", entry, choices or {})
    parts = [yaml.safe_load((root / "trainer" / "config" / "_generated_ppo_trainer.yaml").read_text())]
    name = entry_of(entry).config_name
    own = next(iter(root.glob(f"experimental/*/config/{name}.yaml")), None)
    if own is not None:
        data = yaml.safe_load(own.read_text()) or {}
        parts.append({k: v for k, v in data.items() if k not in ("defaults", "hydra")})
    else:
        nested: dict[str, Any] = {}
        for key, value in ENTRIES[entry].defaults.items():
            set_dotted(nested, key, value)
        parts.append(nested)
    return parts


def sft_base(folder: Path, entry: str, choices: dict[str, str]) -> list[dict[str, Any]]:
    name = entry_of(entry).config_name
    if not (folder / f"{name}.yaml").is_file():
        raise DataError(f"the installed verl ships no {name}.yaml, the config of {entry}; the parity table reads verl 0.9.1's")
    missing: list[str] = []
    parts = [part for group, option in {**SFT_GROUPS, **choices}.items() for part in compose(folder, f"{group}/{option}", group, missing)]
    if missing:
        raise DataError(f"verl's config folder has no {', '.join(missing)}; choose a group option it ships")
    own = yaml.safe_load((folder / f"{name}.yaml").read_text()) or {}
    return [*parts, {k: v for k, v in own.items() if k not in ("defaults", "hydra")}]


def rows(conversion: Any, resolved: dict[str, Any]) -> list[tuple[str, Any, str, str]]:
    """``(verl key, value, status, trellis key or why)`` for every key of verl's ``resolved`` config."""
    reported = {key: why for key, _, why in conversion.unmapped}
    set_by = {}
    for trellis_key, verl_key in conversion.origin.items():
        set_by.setdefault(verl_key, trellis_key)
    out = []
    for key, value in resolved.items():
        if key in conversion.differences:
            out.append((key, value, "DIFF", conversion.differences[key][1]))
        elif key in reported:
            out.append((key, value, "SILENT" if reported[key] == GENERIC else "NOT CONVERTED", reported[key]))
        else:
            out.append((key, value, "SAME", set_by.get(key, "trellis does the same")))
    return out


STATUSES = ("SAME", "DIFF", "NOT CONVERTED", "SILENT")


def counts(table: list[tuple[str, Any, str, str]]) -> dict[str, int]:
    """How many keys have each status, in ``STATUSES`` order."""
    found = Counter(status for _, _, status, _ in table)
    return {status: found[status] for status in STATUSES}
