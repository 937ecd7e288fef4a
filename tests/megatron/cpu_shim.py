"""TEST SCAFFOLDING, never part of the package: lets Megatron-Core run on a CPU-only machine.

Megatron-Core 0.16 assumes CUDA in places the CPU tests reach: ``torch.cuda.current_device()``
for buffers and broadcasts (DDP grad buffers, the optimizer, ``forward_backward_func``, mbridge's
pipeline broadcast), ``torch.cuda.synchronize()`` around pipeline sends, ``device="cuda"`` / ``.cuda()`` on new tensors, and the CUDA RNG tracker
that forks ``torch.cuda`` generator states around dropout. ``install()`` makes every such
request land on the CPU: a ``TorchFunctionMode`` rewrites CUDA devices to ``cpu`` in every torch
call made through the Python API, ``torch.cuda.current_device`` answers 0 (rewritten to cpu by
the mode), and the RNG tracker's ``fork`` becomes a no-op context (dropout is 0 in these tests,
so no random draw depends on it), and SGLang's ``flash_mla`` (CUDA-only, it fails Megatron's
import on a CPU) is hidden. Nothing here runs on a machine with a GPU: ``install`` is a
no-op where CUDA is available, so the package meets the real CUDA paths there.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def _to_cpu(device):
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaToCpu(TorchFunctionMode):
    """Every ``device=`` argument naming CUDA (or a bare device index) becomes ``cpu``;
    ``Tensor.cuda()`` returns the tensor; ``Tensor.to('cuda')`` stays on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func in (torch.Tensor.to,) and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def install(mrandom=None) -> None:
    """Install the CPU redirection in this process (idempotent; a no-op when CUDA is available).
    ``mrandom``: Megatron's ``tensor_parallel.random`` module, when the caller is importing it."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    if mrandom is None:
        from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda device=None: None  # pipeline p2p waits for CUDA streams
    # the tracker saves and swaps torch.cuda generator states; on the CPU it forks nothing
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    mrandom.CudaRNGStatesTracker.add = lambda self, name, seed: None
    CudaToCpu().__enter__()  # for the life of the process
    # SGLang's flash_mla wheel loads its CUDA library when imported and raises OSError without
    # one; Megatron's attention module guards that import against ImportError only. No MLA kernel
    # runs on a CPU: make the import an ImportError (a None entry halts it).
    sys.modules.setdefault("flash_mla", None)
    _installed = True
