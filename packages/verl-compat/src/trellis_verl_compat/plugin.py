"""The ``trellis config from-verl`` command, added to the ``trellis`` command by entry point; the
``verl_default`` reward (verl's own scoring); the ``verl`` class adapter (verl interactions and tools)
and agent loop (verl ``AgentLoopBase`` subclasses)."""

from __future__ import annotations

import argparse
import sys

from omegaconf import OmegaConf

import trellis


@trellis.hookimpl
def trellis_register(registry):
    from trellis_verl_compat.adapters import VerlClasses
    from trellis_verl_compat.agent_loop import VerlAgentLoop, VerlAgentLoopOptions
    from trellis_verl_compat.scoring import verl_default

    registry.add("reward", "verl_default", verl_default)
    registry.add("class_adapter", "verl", VerlClasses())
    registry.add("agent_loop", "verl", VerlAgentLoop, options=VerlAgentLoopOptions)


@trellis.hookimpl
def trellis_add_commands(commands):
    p = commands.add(
        "config from-verl",
        from_verl,
        help="print the trellis config (rl; sft for verl's SFT trainer) for a verl launch script or config; unconverted keys go to stderr",
    )
    p.add_argument("verl", nargs="+", help="a verl launch script (.sh), verl YAML files and/or key=value overrides as given to verl's entry point")
    p.add_argument("--entry", help="the verl entry point the keys are for (default: the script's, else verl.trainer.main_ppo)")
    p.add_argument("--config-path", help="hydra's --config-path (overrides the script's)")
    p.add_argument("--config-name", help="hydra's --config-name (overrides the script's)")
    p.add_argument("--parity", action="store_true", help="print every key of verl's resolved config (verl installed) as SAME, DIFF or NOT CONVERTED")


def from_verl(args: argparse.Namespace) -> int:
    from trellis_verl_compat.convert import check_converted, convert, read_launch, report

    registry = args.plugins.registry
    given, entry, missing = read_launch(args.verl, args.entry, args.config_path, args.config_name, resolved=args.parity)
    conversion = convert(given, registry, entry)
    if args.parity:
        return print_parity(conversion, given)
    conversion.unmapped += [("defaults", item, "not found under --config-path; its settings are not converted") for item in missing]
    check_converted(conversion, registry)
    recipe = conversion.config["recipe"]
    print(f"# trellis {recipe} config converted from verl ({entry}) by trellis config from-verl; check it with trellis config show")
    print(OmegaConf.to_yaml(OmegaConf.create(conversion.config)).rstrip())
    if report(conversion):
        print(report(conversion), file=sys.stderr)
    return 0


def print_parity(conversion, given) -> int:
    """The parity table on stdout (a markdown table, then one RESULT line); 1 when a key is SILENT."""
    from trellis_verl_compat.parity import counts, rows

    table = rows(conversion, given)
    print("| verl key | verl value | status | trellis key or why |\n| --- | --- | --- | --- |")
    for key, value, status, what in table:
        print(f"| `{key}` | `{value!r}` | {status} | {what} |")
    found = counts(table)
    print("RESULT " + " ".join(f"{status.lower().replace(' ', '_')}={n}" for status, n in found.items()))
    return 1 if found["SILENT"] else 0
