"""Hook specifications: the points where a Trellis plugin plugs in.

A plugin is a module (or object) with functions named like these specs and marked with
``@trellis.hookimpl``. Each may accept any subset of the documented arguments.
"""

from __future__ import annotations

import pluggy

PROJECT = "trellis"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def trellis_add_kinds(registry):
    """Add kinds of component of this plugin's own with ``registry.add_kind(name)`` (as pytest's
    ``pytest_addhooks`` adds hooks): e.g. a recipe that looks up ``teacher_loss`` components by
    name. Called for every plugin before any ``trellis_register``, so any plugin may register
    components of any kind; a kind that exists already is an error naming both plugins.
    """


@hookspec
def trellis_register(registry):
    """Add this plugin's named components to ``registry`` with ``registry.add(kind, name, obj)``.

    Called once per plugin when the plugin manager starts. ``kind`` is one of
    :data:`trellis.registry.KINDS` or one a plugin added; adding a name that another plugin already added is an error.
    """


@hookspec
def trellis_train_start(config, run_dir):
    """A recipe is about to run its first step. ``config`` is the resolved, validated config
    (an omegaconf ``DictConfig``); ``run_dir`` the run folder (``pathlib.Path``)."""


@hookspec
def trellis_step_end(step, metrics):
    """A training step finished. ``step`` is 1-based; ``metrics`` maps names to floats."""


@hookspec
def trellis_checkpoint_saved(step, path):
    """A checkpoint for ``step`` was completely written to ``path``."""


@hookspec
def trellis_train_end(run_dir, metrics):
    """A run that started (``trellis_train_start`` fired) finished, normally or with an error.
    ``metrics`` holds the last step's figures."""


@hookspec
def trellis_add_commands(commands):
    """Add subcommands to the ``trellis`` command (as pytest's ``pytest_addoption`` adds options):
    ``parser = commands.add("serve", run, help="...")``, or ``commands.add("config NAME", ...)`` under
    a command group, returns the new command's ``argparse`` parser for its arguments; ``run(args)``
    runs it and returns the exit status (``args.plugins``: the loaded plugins; ``args.argv``: the
    command line). Core's commands are added first; a command that exists
    already is an error naming the module of each."""
