"""Test scaffolding, not part of trellis-rollout-sglang: a stand-in for ``sgl_kernel`` on machines without
a GPU.

``sglang-kernel`` ships CUDA kernels only, and its ``__init__`` loads them (``common_ops``), which
fails without ``libcuda``; SGLang imports names from it at module level even on its CPU path. This
stand-in runs the installed package's own ``__init__`` with the two loader calls made no-ops, so
every pure-Python submodule and name SGLang imports is the real one. No kernel is called on CPU
(SGLang's torch-native paths run instead); one that were would fail loudly, as ``torch.ops``
has no ``sgl_kernel`` namespace here. ``tests/sglang/conftest.py`` puts this folder first on the
path of the test process and of SGLang's subprocesses.
"""

import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_spec = next(
    (s for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(_here)
     for s in [importlib.machinery.PathFinder.find_spec("sgl_kernel", [p])] if s is not None),
    None,
)  # fmt: skip
if _spec is None or not _spec.origin:
    raise ImportError("the sgl_kernel stand-in needs the real sglang-kernel installed (pip install sglang==0.5.23)")
__path__ = list(_spec.submodule_search_locations)

from sgl_kernel import load_utils as _load_utils  # noqa: E402  (the real module, found through __path__)

_load_utils._load_architecture_specific_ops = lambda: None
_load_utils._preload_cuda_library = lambda: None
with open(_spec.origin) as _f:
    exec(compile(_f.read(), _spec.origin, "exec"))
