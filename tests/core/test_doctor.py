"""``trellis doctor`` in a fresh process: every line a bug report needs, the values this
environment holds, and no engine imported to read its version."""

from __future__ import annotations

import importlib.metadata as metadata
import platform
import subprocess
import sys
from pathlib import Path

import torch

ENGINE_MODULES = ("vllm", "sglang", "megatron", "mbridge", "ray")


def version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def test_doctor_reports_the_machine_without_importing_engines():
    code = (
        "import sys\nfrom trellis.cli import main\ncode = main(['doctor'])\n"
        f"print('imported engines:', sorted(m for m in {ENGINE_MODULES!r} if m in sys.modules))\nsys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert lines["python"].startswith(platform.python_version())
    assert lines["torch"] == f"{torch.__version__} (CUDA build {torch.version.cuda or 'none'})"
    assert lines["cuda available"] == str(torch.cuda.is_available())
    assert f"trellis-core {version('trellis-core')}" in lines["trellis packages"]
    assert lines[f"plugin core (trellis-core {version('trellis-core')})"].startswith("loaded, ")
    for name in ("vllm", "sglang", "megatron-core", "ray", "peft", "openai"):
        assert lines[name] == version(name), name
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    assert lines["trellis commit"].startswith(commit or "not a git checkout")
    assert lines["user namespaces"].split(" ")[0] in ("available", "unavailable", "unknown")
    assert any(key.startswith("free disk, current folder") and " GiB" in value for key, value in lines.items())
    assert lines["imported engines"] == "[]"
