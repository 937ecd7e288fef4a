"""Trellis: reinforcement-learning post-training for language models, as a core plus plugins."""

from importlib.metadata import version

from trellis.batch import Batch
from trellis.hookspecs import hookimpl
from trellis.registry import KINDS, Registry, RegistryError

__version__ = version("trellis-core")
__all__ = ["KINDS", "Batch", "Registry", "RegistryError", "hookimpl", "__version__"]
