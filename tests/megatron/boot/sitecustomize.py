"""TEST SCAFFOLDING: puts the Megatron CPU shim (``tests/megatron/cpu_shim.py``) into every Python
process of a test run, Ray's rank processes included, when ``TRELLIS_TEST_MEGATRON_CPU_SHIM=1``.

Python imports ``sitecustomize`` at start-up from ``sys.path``; the Megatron tests that launch
recipes put this folder and ``tests/megatron`` on ``PYTHONPATH``. The shim is installed once
``megatron.core.tensor_parallel.random`` is first imported (processes that never import Megatron,
such as Ray's own helpers, pay nothing)."""

import importlib.abc
import importlib.machinery
import os
import sys

TARGET = "megatron.core.tensor_parallel.random"


class _InstallShimAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            sys.modules[name] = module
            import cpu_shim

            cpu_shim.install(module)

        spec.loader.exec_module = exec_then_install
        return spec


if os.environ.get("TRELLIS_TEST_MEGATRON_CPU_SHIM") == "1":
    sys.meta_path.insert(0, _InstallShimAfterImport())
