"""Registers the ``megatron`` backend. Megatron-Core is imported when a backend is built, not when
plugins load (so ``trellis`` commands that do not train stay quick)."""

from __future__ import annotations

from trellis import hookimpl
from trellis_megatron.options import MegatronOptions


def make_backend(spec):
    """A ``MegatronBackend`` for ``spec`` (``trellis.kit.backend.BackendSpec``)."""
    from trellis_megatron.backend import MegatronBackend

    return MegatronBackend(spec)


@hookimpl
def trellis_register(registry):
    registry.add("backend", "megatron", make_backend, options=MegatronOptions)
