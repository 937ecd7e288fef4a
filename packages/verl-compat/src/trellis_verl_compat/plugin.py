"""The ``trellis config from-verl`` command, added to the ``trellis`` command by entry point."""

from __future__ import annotations

import argparse
import sys

from omegaconf import OmegaConf

import trellis


@trellis.hookimpl
def trellis_add_commands(commands):
    p = commands.add("config from-verl", from_verl, help="print the trellis rl config for a verl PPO/GRPO config; unconverted keys go to stderr")
    p.add_argument("verl", nargs="+", help="verl YAML files and/or key=value overrides as given to verl.trainer.main_ppo")


def from_verl(args: argparse.Namespace) -> int:
    from trellis_verl_compat.convert import check_converted, convert, read_verl, report

    registry = args.plugins.registry
    conversion = convert(read_verl(args.verl), registry)
    check_converted(conversion, registry)
    print("# trellis rl config converted from verl by trellis config from-verl; check it with trellis config show")
    print(OmegaConf.to_yaml(OmegaConf.create(conversion.config)).rstrip())
    if report(conversion):
        print(report(conversion), file=sys.stderr)
    return 0
