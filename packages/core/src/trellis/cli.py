"""The ``trellis`` command: plugins, config show, train (and tools added by later commands)."""

from __future__ import annotations

import argparse
import logging
import sys

from omegaconf import OmegaConf

from trellis import config as config_mod
from trellis.plugins import load_plugins
from trellis.registry import KINDS, RegistryError


def cmd_plugins(args: argparse.Namespace) -> int:
    plugins = load_plugins()
    for info in plugins.infos:
        status = f"FAILED: {info.error}" if info.error else f"{len(info.registered)} components"
        print(f"{info.name}  ({info.distribution} {info.version})  {status}")
        by_kind: dict[str, list[str]] = {}
        for kind, name in info.registered:
            by_kind.setdefault(kind, []).append(name)
        for kind in KINDS:
            if kind in by_kind:
                print(f"    {kind}: {', '.join(by_kind[kind])}")
    for kind, what in (("backend", "training backend"), ("rollout", "rollout engine")):
        if not plugins.registry.names(kind):
            print(f"no {what} is installed ({kind}): e.g. pip install trellis-{'backend-fsdp' if kind == 'backend' else 'rollout-hf'}")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    plugins = load_plugins()
    cfg = config_mod.compose(args.config, args.overrides, plugins.registry)
    print(OmegaConf.to_yaml(cfg).rstrip())
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from trellis.recipe import train

    train(args.config, args.overrides)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trellis", description="RL post-training for language models")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plugins", help="list installed plugins, what they registered and load errors")
    p.set_defaults(func=cmd_plugins)
    p = sub.add_parser("config", help="config tools")
    csub = p.add_subparsers(dest="config_command", required=True)
    p = csub.add_parser("show", help="print the composed, validated config with defaults")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value")
    p.set_defaults(func=cmd_config_show)
    p = sub.add_parser("train", help="run the recipe the config names")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value")
    p.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (config_mod.ConfigError, RegistryError) as exc:
        print(f"trellis: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
