"""The languages the server runs: source file name, compile command (if any) and run command."""

from __future__ import annotations

import shutil
from dataclasses import dataclass


@dataclass(frozen=True)
class Language:
    source: str
    compile: tuple[str, ...] | None
    run: tuple[str, ...]


def available_languages(python: str) -> dict[str, Language]:
    """``python`` always; ``cpp`` and ``c`` where g++ / gcc are installed."""
    langs = {"python": Language("main.py", None, (python, "main.py"))}
    if shutil.which("g++"):
        langs["cpp"] = Language("main.cpp", ("g++", "-O2", "-std=c++17", "-o", "main", "main.cpp"), ("./main",))
    if shutil.which("gcc"):
        langs["c"] = Language("main.c", ("gcc", "-O2", "-std=c11", "-o", "main", "main.c", "-lm"), ("./main",))
    return langs


def default_python() -> str:
    """The system's python3 (not a virtual environment's, whose folder may be unreadable to the sandbox user)."""
    found = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if found is None:
        raise RuntimeError("no python3 in /usr/local/bin, /usr/bin or /bin; pass --python PATH")
    return found
