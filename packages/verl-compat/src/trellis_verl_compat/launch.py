"""What a verl user launches: a shell script's ``python3 -m <entry> [--config-path P --config-name N]
key=value ...`` line read without running it, the recipe and mode its entry point selects, and the
hydra YAML it names with its ``defaults:`` followed inside the config folder."""

from __future__ import annotations

import ast
import operator
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trellis import DataError


@dataclass(frozen=True)
class Entry:
    """A verl entry point: the trellis async mode it runs (``off``, ``one_step``, ``fully_async``),
    the hydra config it loads by default, that config's defaults above verl's ppo_trainer and the
    trellis recipe it converts to (``rl``, ``sft``)."""

    mode: str
    config_name: str
    defaults: dict[str, Any] = field(default_factory=dict)
    recipe: str = "rl"


MAIN_PPO = "verl.trainer.main_ppo"
SFT_TRAINER = "verl.trainer.sft_trainer"
FULLY_ASYNC_DEFAULTS = {  # verl 0.9.1's fully_async_ppo_trainer.yaml
    "async_training.staleness_threshold": 0.1,
    "async_training.trigger_parameter_sync_step": 4,
    "async_training.require_batches": 1,
    "async_training.partial_rollout": True,
    "rollout.total_rollout_steps": 100,
    "data.gen_batch_size": 1,
}
# verl's older SFT trainer (fsdp_sft_trainer, before verl 0.9): its sft_trainer.yaml where it differs from the engine trainer's
LEGACY_SFT_DEFAULTS = {
    "optim.lr": 1e-5,
    "optim.betas": [0.9, 0.95],
    "optim.warmup_steps_ratio": 0.1,
    "optim.lr_scheduler": "cosine",
    "model.use_remove_padding": False,
    "data.prompt_key": "question",
    "data.response_key": "answer",
}

ENTRIES = {
    MAIN_PPO: Entry("off", "ppo_trainer"),
    "recipe.dapo.main_dapo": Entry("off", "dapo_trainer", {"reward_model.reward_manager": "dapo"}),
    **{f"{pkg}.one_step_off_policy.main_ppo": Entry("one_step", "one_step_off_ppo_trainer") for pkg in ("verl.experimental", "recipe")},
    **{
        f"{pkg}.fully_async_policy.fully_async_main": Entry("fully_async", "fully_async_ppo_trainer", FULLY_ASYNC_DEFAULTS)
        for pkg in ("verl.experimental", "recipe")
    },
    SFT_TRAINER: Entry("off", "sft_trainer_engine", recipe="sft"),  # verl 0.9.1's engine SFT trainer
    "verl.trainer.fsdp_sft_trainer": Entry("off", "sft_trainer", LEGACY_SFT_DEFAULTS, recipe="sft"),  # before verl 0.9
}
# entry points of verl's other trainers: what to use in trellis instead
OTHER_ENTRIES = {
    "verl.trainer.main_generation": "generation only; trellis has no generation entry point",
    "verl.trainer.main_generation_server": "generation only; trellis has no generation entry point",
    "verl.trainer.main_eval": "evaluation only; trellis evaluates held-out data in training runs (data.val_path)",
}
# verl's own top-level configs: their settings are the converter's verl defaults, not files to merge,
# but for what a config chooses that the defaults do not (its engine)
BASE_SETTINGS = {"ppo_megatron_trainer": {"actor_rollout_ref": {"actor": {"strategy": "megatron"}}}}
VERL_BASES = {e.config_name for e in ENTRIES.values()} | set(BASE_SETTINGS)


def module_of(name: str) -> str:
    """The dotted module of an entry point given as a module or a path to its ``.py`` file (a
    checkout's path ends in the module's: ``/src/verl/verl/trainer/main_ppo.py``)."""
    if not name.endswith(".py"):
        return name
    dotted = name[:-3].replace("/", ".").strip(".")
    return next((known for known in [*ENTRIES, *OTHER_ENTRIES] if dotted == known or dotted.endswith("." + known)), dotted)


def entry_of(name: str) -> Entry:
    """The entry point ``name`` (a module, or a path to its ``.py`` file), or a refusal naming the known ones."""
    module = module_of(name)
    if module in ENTRIES:
        return ENTRIES[module]
    if module in OTHER_ENTRIES:
        raise DataError(f"verl entry point {module} is {OTHER_ENTRIES[module]}; from-verl converts RL and SFT runs ({', '.join(ENTRIES)})")
    raise DataError(f"verl entry point {module!r} is not one from-verl knows; it converts {', '.join(ENTRIES)}")


@dataclass
class Launch:
    """A verl command: its entry point, the hydra config it names (or None: the entry's own) and its overrides."""

    entry: str = MAIN_PPO
    config_path: str | None = None
    config_name: str | None = None
    overrides: list[str] = field(default_factory=list)


def read_script(path: Path) -> Launch:
    """The verl command in shell script ``path``: variables, ``${VAR:-default}``, arrays and
    ``$((arithmetic))`` expanded as bash would (the environment's variables included), nothing
    run; ``"$@"`` is dropped (give those overrides after the script)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"verl launch script {str(path)!r} cannot be read ({type(exc).__name__})") from None
    env: dict[str, Any] = {**os.environ, "0": str(path), "BASH_SOURCE": [str(path)], "PWD": str(Path.cwd())}
    others = []  # python commands of the script that run no verl trainer (data preparation...)
    for line in _statements(text):
        assigned = re.fullmatch(r"(?:export\s+|local\s+|readonly\s+)?(\w+)=(\(.*\)|.*)", line.strip(), re.S)
        if assigned and assigned.group(2).startswith("("):
            env[assigned.group(1)] = _words(assigned.group(2)[1:-1], env)
            continue
        words = _words(line, env)
        if assigned and len(words) == 1:
            env[assigned.group(1)] = words[0].split("=", 1)[1]
            continue
        launch = _command(words)
        if launch is not None and module_of(launch.entry) in (*ENTRIES, *OTHER_ENTRIES):
            launch.entry = module_of(launch.entry)
            if launch.entry in ENTRIES and ENTRIES[launch.entry].recipe == "sft":  # verl's SFT runs as many ranks as torchrun starts
                launch.overrides = [*_torchrun_world(words), *launch.overrides]
            return launch
        if launch is not None:
            others.append(launch.entry)
    also = f" (its python commands run {', '.join(others)})" if others else ""
    raise DataError(f"verl launch script {str(path)!r} has no 'python3 -m <verl entry point> ...' line{also}; give its keys instead")


def _statements(text: str) -> list[str]:
    """Lines with backslash continuations joined and array assignments ``NAME=( ... )`` made one."""
    lines, current, depth = [], "", 0
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.split(" #")[0] if not raw.lstrip().startswith("#") else ""
        current += " " + line
        depth += line.count("(") - line.count(")") if re.match(r"\s*\w+=\(", current) else 0
        if depth <= 0:
            lines.append(current.strip())
            current, depth = "", 0
    return [line for line in lines if line]


def _words(text: str, env: dict[str, Any]) -> list[str]:
    """``text`` split into shell words after expansion; an array expands to its elements."""
    try:
        return shlex.split(_expand(text, env), comments=True)
    except ValueError as exc:
        raise DataError(f"a line of the launch script cannot be read as shell words ({exc}): {text.strip()[:120]}") from None


def _expand(text: str, env: dict[str, Any]) -> str:
    """bash's parameter and arithmetic expansion of ``text`` (not inside single quotes):
    ``$NAME``, ``${NAME}``, ``${NAME:-default}`` (the default expanded in turn), ``"${ARR[@]}"``
    (each element one word), ``$((expr))``; ``$@`` and ``$*`` are empty."""
    out, i, quoted = [], 0, False
    while i < len(text):
        c = text[i]
        if c == "'" and not quoted:
            end = text.find("'", i + 1)
            end = len(text) - 1 if end < 0 else end
            out.append(text[i : end + 1])
            i = end + 1
            continue
        if c == '"':
            quoted = not quoted
        if c != "$" or i + 1 >= len(text):
            out.append(c)
            i += 1
            continue
        if text.startswith("$((", i):
            end = _closing(text, i + 1, "(", ")")
            out.append(str(_arithmetic(_expand(text[i + 3 : end - 1], env), env)))
            i = end + 1
        elif text.startswith("$(", i):
            end = _closing(text, i + 1, "(", ")")
            out.append(_substitution(text[i + 2 : end], env))
            i = end + 1
        elif text[i + 1] == "{":
            end = _closing(text, i + 1, "{", "}")
            out.append(_parameter(text[i + 2 : end], env, quoted))
            i = end + 1
        else:
            name = re.match(r"\w+|[@*#?]", text[i + 1 :])
            value = env.get(name.group(0)) if name and name.group(0) not in "@*" else ""
            out.append(shlex.quote(value[0]) if isinstance(value, list) and value else value if isinstance(value, str) else "")
            i += 1 + (len(name.group(0)) if name else 0)
    return "".join(out)


def _substitution(command: str, env: dict[str, Any]) -> str:
    """``$(command)`` for the commands launch scripts use to name folders and runs (``pwd``,
    ``basename P``, ``dirname P``, ``cd D && pwd``), answered without running anything; any
    other is kept as written."""
    try:
        words = shlex.split(_expand(command, env))
    except ValueError:
        return f"$({command})"
    if words == ["pwd"]:
        return str(env.get("PWD") or Path.cwd())
    if len(words) in (2, 3) and words[0] == "basename":
        return Path(words[1]).name.removesuffix(words[2] if len(words) == 3 else "")
    if len(words) == 2 and words[0] == "dirname":
        return str(Path(words[1]).parent)
    if len(words) == 4 and words[0] == "cd" and words[2:] == ["&&", "pwd"]:
        return str((Path(str(env.get("PWD") or Path.cwd())) / words[1]).resolve())
    return f"$({command})"


def _closing(text: str, start: int, open_: str, close: str) -> int:
    """The index of the bracket closing the one at ``start``."""
    depth = 0
    for j in range(start, len(text)):
        depth += (text[j] == open_) - (text[j] == close)
        if depth == 0:
            return j
    raise DataError(f"an unclosed {open_!r} in the launch script: {text[start - 1 :][:80]}")


def _parameter(inner: str, env: dict[str, Any], quoted: bool) -> str:
    """One ``${...}``: a variable, an array's elements, or a default after ``:-`` / ``-``."""
    match = re.fullmatch(r"(\w+)(\[[@*]\])?(?::?[-=](.*))?", inner, re.S)
    if match is None:
        raise DataError(f"the launch script's ${{{inner}}} is not a variable bash's expansion from-verl reads; give the value")
    name, array, default = match.groups()
    got = env.get(name)
    if isinstance(got, list):
        words = got if array else got[:1]
        joined = " ".join(shlex.quote(word) for word in words)
        return f'"{joined}"' if quoted else joined  # closes and reopens the quotes around the elements
    if got in (None, "") and default is not None:
        return _expand(default, env)
    return got or ""


OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv, ast.Mod: operator.mod}


def _arithmetic(expr: str, env: dict[str, Any]) -> int:
    """bash's integer ``$((expr))``: + - * / % and parentheses over numbers and variables."""
    expanded = re.sub(r"\$?\b([A-Za-z_]\w*)\b", lambda m: str(env.get(m.group(1), 0) or 0), expr)

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise DataError(f"the launch script's $(({expr})) is not integer arithmetic; give the value")

    try:
        return value(ast.parse(expanded.strip(), mode="eval").body)
    except (SyntaxError, ZeroDivisionError):
        raise DataError(f"the launch script's $(({expr})) cannot be computed; give the value") from None


def _torchrun_world(words: list[str]) -> list[str]:
    """torchrun's ``--nproc_per_node`` and ``--nnodes`` (whole numbers) as verl's trainer keys."""
    keys = {"--nproc_per_node": "trainer.n_gpus_per_node", "--nproc-per-node": "trainer.n_gpus_per_node", "--nnodes": "trainer.nnodes"}
    found = {}
    for i, word in enumerate(words):
        flag, _, value = word.partition("=")
        value = value or (words[i + 1] if i + 1 < len(words) else "")
        if flag in keys and value.isdigit():
            found[keys[flag]] = value
    return [f"{key}={value}" for key, value in found.items()]


def _command(words: list[str]) -> Launch | None:
    """The verl command in one line's words (after any ``env``, ``ray job submit ... --`` or
    ``torchrun`` before the interpreter), or None."""
    for i, word in enumerate(words):
        name = Path(word).name
        if name == "torchrun" and "-m" in words[i:-1]:
            i = words.index("-m", i) - 1  # torchrun's own options end at its -m
        elif not name.startswith("python") or i + 1 >= len(words):
            continue
        if words[i + 1] == "-m" and i + 2 < len(words):
            entry, args = words[i + 2], words[i + 3 :]
        elif words[i + 1].endswith(".py"):
            entry, args = words[i + 1], words[i + 2 :]
        else:
            continue
        launch = Launch(entry=entry)
        flags = {"--config-path": "config_path", "-cp": "config_path", "--config-name": "config_name", "-cn": "config_name"}
        pending = None
        for arg in args:
            if pending:
                setattr(launch, pending, arg)
                pending = None
            elif arg in flags:
                pending = flags[arg]
            elif arg.split("=", 1)[0] in flags:
                setattr(launch, flags[arg.split("=", 1)[0]], arg.split("=", 1)[1])
            elif "=" in arg:
                launch.overrides.append(arg)
        return launch
    return None


def config_files(launch: Launch, base: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The hydra config ``launch`` names, as mappings to merge in order (its ``defaults:``
    followed inside the config folder, verl's own top-level configs left to the converter's verl
    defaults), and the defaults entries that were not found. ``base``: where a relative
    ``--config-path`` is looked up after the working directory."""
    if launch.config_name is None:
        return [], []
    name = launch.config_name.removesuffix(".yaml")
    base_settings = [BASE_SETTINGS[name]] if name in BASE_SETTINGS else []
    if launch.config_path is None and name in VERL_BASES:
        return base_settings, []
    tried = [Path(launch.config_path or ".")] + (
        [base / launch.config_path] if launch.config_path and not Path(launch.config_path).is_absolute() else []
    )
    folder = next((p for p in tried if (p / f"{name}.yaml").is_file()), None)
    if folder is None:
        if name in VERL_BASES:
            return base_settings, []
        raise DataError(
            f"--config-name {name} is not a file under --config-path ({', '.join(map(str, tried))}); give the folder that holds {name}.yaml"
        )
    missing: list[str] = []
    return compose(folder, name, None, missing), missing


def compose(folder: Path, name: str, package: str | None, missing: list[str]) -> list[dict[str, Any]]:
    """One config file and its defaults, in hydra's order (``_self_`` where listed, else last),
    under ``package`` (dotted; None: at the top); defaults not found are added to ``missing``."""
    data = yaml.safe_load((folder / f"{name}.yaml").read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise DataError(f"hydra config {folder / name}.yaml is not a mapping")
    defaults = data.pop("defaults", None) or []
    data.pop("hydra", None)
    own = [_at(package, data)]
    parts: list[dict[str, Any]] = []
    if "_self_" not in defaults:
        defaults = [*defaults, "_self_"]
    for item in defaults:
        if item == "_self_":
            parts += own
            continue
        group, option = next(iter(item.items())) if isinstance(item, dict) else (None, item)
        group = str(group).removeprefix("override ") if group is not None else None
        if option is None or option in VERL_BASES:
            continue
        target, _, at = (group or "").partition("@")
        path = Path(target) / str(option) if target else Path(str(option))
        if (folder / f"{path}.yaml").is_file():
            child = ".".join(p for p in (package, at or target.replace("/", ".")) if p)
            parts += compose(folder, str(path), child or None, missing)
        else:
            missing.append(f"{group}: {option}" if group else str(option))
    return parts


def _at(package: str | None, data: dict[str, Any]) -> dict[str, Any]:
    for part in reversed((package or "").split(".") if package else []):
        data = {part: data}
    return data
