"""The ``trellis`` command's subcommands: core's and those plugins add (``trellis_add_commands``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from trellis.registry import RegistryError

# commands that moved out of core -> the package that brings them (named when one is missing)
MOVED = {"config from-verl": "trellis-verl-compat", "demo": "trellis-demo", "make-tiny-model": "trellis-demo"}


class Commands:
    """Subcommands of one ``argparse`` parser, each owned by the module of its ``run`` function;
    groups (``config``) hold subcommands of their own."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        self._top = parser.add_subparsers(dest="command", required=True)
        self._groups: dict[str, argparse._SubParsersAction] = {}
        self._owners: dict[str, str] = {}

    def add(self, path: str, run: Callable[[argparse.Namespace], int] | None, help: str, **parser_args) -> argparse.ArgumentParser:
        """Add the command ``path`` (``"train"``, or ``"GROUP NAME"`` for one in a group); ``run``
        None makes ``path`` a group. Returns its parser."""
        group, _, name = path.rpartition(" ")
        owner = getattr(run, "__module__", None) or "a command group"
        if path in self._owners:
            raise RegistryError(f"trellis command {path!r} is added twice: by {self._owners[path]} and by {owner}; uninstall one of their packages")
        if group and group not in self._groups:
            raise RegistryError(f"trellis command {path!r} ({owner}) names no command group {group!r}; groups: {', '.join(self._groups) or 'none'}")
        parser = (self._groups[group] if group else self._top).add_parser(name, help=help, **parser_args)
        self._owners[path] = owner
        if run is None:
            self._groups[path] = parser.add_subparsers(dest=f"{path}_command", required=True)
        else:
            parser.set_defaults(func=run)
        return parser

    def missing(self, argv: list[str]) -> str | None:
        """The one-line error for ``argv`` naming a command whose package is not installed, if it does."""
        for path, package in MOVED.items():
            if argv[: len(path.split())] == path.split() and path not in self._owners:
                return f"`trellis {path}` comes with the {package} package, which is not installed: pip install {package}"
        return None
