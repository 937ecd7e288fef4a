"""The ``trellis`` command: plugins, doctor, config show/init, train, eval, plot, export, and the plugins' commands."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from importlib.resources import files

from omegaconf import OmegaConf
from pluggy import PluginValidationError

from trellis import config as config_mod
from trellis.commands import Commands
from trellis.data import DataError
from trellis.plot import DEFAULT_METRICS
from trellis.plugins import Plugins, load_plugins
from trellis.registry import RegistryError
from trellis.rewards import RewardError

# `trellis config init NAME` prints starters/starter_NAME.yaml when there is one
STARTERS = {
    p.name.removeprefix("starter_").removesuffix(".yaml"): p for p in (files("trellis") / "starters").iterdir() if p.name.startswith("starter_")
}


def cmd_plugins(args: argparse.Namespace) -> int:
    plugins = args.plugins
    for info in plugins.infos:
        status = f"FAILED: {info.error}" if info.error else f"{len(info.registered)} components"
        print(f"{info.name}  ({info.distribution} {info.version})  {status}")
        by_kind: dict[str, list[str]] = {}
        for kind, name in info.registered:
            by_kind.setdefault(kind, []).append(name)
        for kind in plugins.registry.kinds():
            if kind in by_kind:
                print(f"    {kind}: {', '.join(by_kind[kind])}")
    for option in config_mod.unranged_options(plugins.registry):
        print(f"note: numeric option {option} declares no range; make it with trellis.ranged(default, ge=..., ...) so bad values fail at start-up")
    for kind, what in (("backend", "training backend"), ("rollout", "rollout engine")):
        if not plugins.registry.names(kind):
            print(f"no {what} is installed ({kind}): e.g. pip install trellis-{'backend-fsdp' if kind == 'backend' else 'rollout-hf'}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from trellis.doctor import report

    for line in report():
        print(line, flush=True)
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    plugins = args.plugins
    cfg = config_mod.compose(args.config, args.overrides, plugins.registry)
    print(OmegaConf.to_yaml(cfg).rstrip())
    return 0


def cmd_config_init(args: argparse.Namespace) -> int:
    if args.recipe in STARTERS:
        print(STARTERS[args.recipe].read_text(encoding="utf-8").rstrip())
        return 0
    options = config_mod.validate_recipe_config(OmegaConf.create({"recipe": args.recipe}), args.plugins.registry)
    print(f"# The {args.recipe} recipe's options with their defaults; ??? marks what you must set.")
    print(OmegaConf.to_yaml(options).rstrip())
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import shlex

    from trellis.recipes.train import Interrupted, train
    from trellis.runtime.harness import controller_class

    plugins = args.plugins  # once: the controller's decision and the run share it
    if not args.dry_run:  # the controller may run the command elsewhere (Ray: in a loopback-only network namespace)
        cfg = config_mod.compose(args.config, args.overrides, plugins.registry)
        status = controller_class(plugins.registry, cfg.get("trainer") or {}).enter(cfg, args.argv)
        if status is not None:
            return status
    try:
        result = train(args.config, args.overrides, plugins=plugins, dry_run=args.dry_run)
    except Interrupted as stop:
        again = [a for a in args.overrides if not a.startswith("trainer.run_dir=")] + [f"trainer.run_dir={stop.run_dir}"]
        print(f"trellis: interrupted; resume with: {shlex.join(['trellis', 'train', *filter(None, [args.config]), *again])}", file=sys.stderr)
        return 130
    if args.dry_run:
        start = f"resumes from {result['resume_from']}" if result["resume_from"] else "a fresh run"
        print(f"dry run of recipe {result['recipe']}: every check that needs no model passed")
        print(f"  run folder: {result['run_dir']} ({start}; nothing written)")
        print(f"  data: {result['data']}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from trellis.recipes.train import evaluate

    print(json.dumps(evaluate(args.config, args.overrides, plugins=args.plugins)))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trellis.plot import DEFAULT_METRICS, plot_metrics

    runs = [Path(a) for a in args.runs_and_metrics if Path(a).is_dir()]
    metrics = [a for a in args.runs_and_metrics if not Path(a).is_dir()] + (args.metrics or [])
    if not runs:
        print(f"trellis: error: none of {args.runs_and_metrics} is a run folder; give at least one folder holding metrics.jsonl", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else runs[0] / "curves.png"
    try:
        print(plot_metrics(runs, out, metrics or DEFAULT_METRICS))
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"trellis: error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from trellis.export import export_checkpoint

    try:
        print(export_checkpoint(args.checkpoint, args.out_dir, plugins=args.plugins, adapter_only=args.adapter_only))
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"trellis: error: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser(plugins: Plugins | None = None) -> argparse.ArgumentParser:
    """The ``trellis`` command's parser: core's commands and the plugins'."""
    return all_commands(plugins or load_plugins()).parser


def all_commands(plugins: Plugins) -> Commands:
    """Core's commands, then those the installed plugins add (``trellis_add_commands``)."""
    commands = Commands(argparse.ArgumentParser(prog="trellis", description="RL post-training for language models"))
    add = commands.add
    add("plugins", cmd_plugins, help="list installed plugins, what they registered and load errors")
    add("doctor", cmd_doctor, help="what a bug report needs: python, torch/CUDA/NCCL, devices, plugins, engine versions, namespaces, disk")
    add("config", None, help="config tools")
    p = add("config show", cmd_config_show, help="print the composed, validated config with defaults")
    p.add_argument("config", help="a YAML file, or the first key=value override (a run given by overrides alone)")
    p.add_argument("overrides", nargs="*", help="key=value")
    starters = ", ".join(sorted(STARTERS))
    p = add(
        "config init",
        cmd_config_init,
        help="print a commented starter config: trellis config init rl > my_run.yaml",
        description=f"Print a commented starter config ({starters}), or for any other installed recipe (e.g. spin) its options "
        "with their defaults; ??? marks what you must set.",
    )
    p.add_argument("recipe", help=f"a starter ({starters}) or an installed recipe's name")
    p = add("train", cmd_train, help="run the recipe the config names")
    p.add_argument("config", help="a YAML file, or the first key=value override (a run given by overrides alone)")
    p.add_argument("overrides", nargs="*", help="key=value")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="only the checks that need no model (config, ranges, plugin names, trackers, files, columns, prompt lengths, "
        "batch divisibility, the checkpoint to resume); writes nothing",
    )
    p = add("eval", cmd_eval, help="validation alone, once, on model.path (the rl recipe's held-out data.val_path); prints its figures")
    p.add_argument("config", help="a YAML file, or the first key=value override (a run given by overrides alone)")
    p.add_argument("overrides", nargs="*", help="key=value")
    p = add(
        "plot",
        cmd_plot,
        help="PNG curves of metrics from run folders (several runs overlaid)",
        description="trellis plot RUN_DIR [RUN_DIR ...] [METRIC ...]: arguments that are folders are runs, the others metric "
        f"names (e.g. reward/mean actor/entropy). Without a metric: those of {', '.join(DEFAULT_METRICS)} that some run has.",
    )
    p.add_argument("runs_and_metrics", nargs="+", metavar="RUN_DIR_OR_METRIC")
    p.add_argument("--metric", action="append", dest="metrics", help="another metric to plot (repeatable)")
    p.add_argument("--out", default=None, help="PNG path (default: <first run>/curves.png)")
    p = add("export", cmd_export, help="write a checkpoint's policy as a Hugging Face folder (loads without Trellis)")
    p.add_argument("checkpoint", help="RUN_DIR/checkpoint-N, or a run folder (its latest complete checkpoint)")
    p.add_argument("out_dir")
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="a run that trained a LoRA adapter: write the adapter alone as a PEFT folder (loads onto the base model with peft)",
    )
    plugins.hook.trellis_add_commands(commands=commands)
    return commands


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # at INFO it logs every request: a line per model call of an agent
    argv = sys.argv[1:] if argv is None else argv
    try:
        plugins = load_plugins()
        commands = all_commands(plugins)
        if missing := commands.missing(argv):
            raise RegistryError(missing)
        args, rest = commands.parser.parse_known_args(argv)
        # overrides after a flag (`train run.yaml --dry-run k=v`) are left over by argparse
        bad = [r for r in rest if not hasattr(args, "overrides") or "=" not in r or r.startswith("-")]
        if bad:  # named alone: the key=value overrides among them are fine
            tip = "; config overrides are key=value, e.g. actor.optim.lr=1e-5 (trellis config show CONFIG lists the keys)"
            tip = tip if hasattr(args, "overrides") else ""
            commands.parser.error(f"unrecognized arguments: {' '.join(bad)}{tip}")
        if rest:
            args.overrides += rest
        if "=" in getattr(args, "config", "") and not os.path.exists(args.config):  # `trellis train recipe=rl k=v ...`: no file
            args.config, args.overrides = None, [args.config, *args.overrides]
        args.argv, args.plugins = argv, plugins
        return args.func(args)
    except (config_mod.ConfigError, RegistryError, DataError, RewardError, PluginValidationError) as exc:
        print(f"trellis: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
