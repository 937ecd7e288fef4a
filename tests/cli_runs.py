"""``trellis ...`` run in this process (``trellis.cli.main``), its output and exit status kept as a
subprocess's would be: a new interpreter per command cost the CLI tests about 10 s of imports each."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Completed:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would have returned."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str, cwd: str | Path) -> Completed:
    """``trellis *args`` in folder ``cwd``: its exit status and what it wrote, log lines included
    (as the CLI's handler writes them), and what any process it starts wrote (a Ray run re-runs the
    CLI in a network namespace of its own): both streams are caught at their file descriptors."""
    from trellis.cli import main

    with tempfile.TemporaryFile("w+", buffering=1) as out, tempfile.TemporaryFile("w+", buffering=1) as err:
        handler = logging.StreamHandler(err)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root, here, level = logging.getLogger(), os.getcwd(), logging.getLogger().level
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        try:
            os.chdir(cwd)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(list(args))
                except SystemExit as exc:  # argparse's errors
                    code = exc.code if isinstance(exc.code, int) else 1
        finally:
            os.chdir(here)
            root.removeHandler(handler)
            root.setLevel(level)
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        err.seek(0)
        return Completed(int(code or 0), out.read(), err.read())
