"""Trellis algorithms: advantage estimators, policy/KL/SFT/preference losses, loss aggregation."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("trellis-algos")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"
