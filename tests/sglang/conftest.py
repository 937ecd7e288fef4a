"""Fixtures for the SGLang rollout tests, run against the real engine (on CPU here).

Without a GPU, SGLang runs with ``SGLANG_USE_CPU_ENGINE=1`` and needs the ``sgl_kernel`` stand-in
in ``standin/`` (test scaffolding, see its docstring), put first on the path of this process and,
through ``PYTHONPATH``, of SGLang's scheduler and detokenizer subprocesses. The shared tiny models
(4 heads of size 8) run as they are: SGLang's ``torch_native`` attention takes any head size.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [STANDIN, os.environ.get("PYTHONPATH", "")] if p)
    sys.path.insert(0, STANDIN)

sglang = pytest.importorskip("sglang", reason="install sglang to run the SGLang rollout tests")

from engine_cases import pytest_collection_modifyitems  # noqa: E402, F401 - the shared engine tests' order
