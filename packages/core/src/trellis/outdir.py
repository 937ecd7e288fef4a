"""Output folders Trellis replaces whole (tiny models, exports): only when absent, empty or its own."""

from __future__ import annotations

from pathlib import Path


def check_replaceable(out: Path, marker: str, writer: str) -> None:
    """Raise ``FileExistsError`` unless ``out`` is absent, an empty folder, or a folder holding
    ``marker`` (the file ``writer`` leaves in every folder it writes), so a folder of the user's is
    never deleted."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / marker).is_file())):
        raise FileExistsError(f"{writer}: {str(out)!r} exists and was not made by {writer} (no {marker}); choose another folder or delete it")
