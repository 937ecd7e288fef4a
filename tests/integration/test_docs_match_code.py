"""What README.md and docs/*.md tell a user to type exists: every ``trellis <command>`` in their code
is a command of the CLI's parser, every dotted ``key=value`` a key of the rl, sft or spin config
(component options looked up in the registry), the config table of a recipe lists its sections
and only real fields, and the CLI lists of packages/core/README.md and docs/architecture.md name
every command.

Keys of a component whose package is not installed here are looked up in that package's source.
ALLOWED holds the deliberate exceptions: example mistakes, verl's keys, a guide's own example
recipe; each must still be in its document, so the list cannot go stale.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from trellis.cli import build_parser
from trellis.config import COMPONENT_KIND, field_choices, recipe_schema
from trellis.plugins import load_plugins

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RECIPES = ("rl", "sft", "spin", "rm")

ALLOWED = {
    ("docs/config.md", "data.path"): "an example error message (a required key left unset)",
    ("docs/plugins.md", "algorithm.advantage.scal"): "a deliberate typo, to show the error",
    ("docs/plugins.md", "data.batch_prompts"): "a key of the guide's own example recipe best_of_n",
    ("docs/plugins.md", "actor.policy_loss.max_ratio"): "an option of the guide's own example policy loss clipped_reinforce",
    ("docs/coming-from-verl.md", "algorithm.gamma"): "a verl key, in from-verl's report",
    ("docs/coming-from-verl.md", "data.train_batch_size"): "a verl key, given a wrong value",
    ("docs/coming-from-verl.md", "data.max_response_length"): "a verl key, in from-verl's report",
}
# words a config table may name that are no config field
NOT_FIELDS = {"data_source": "a data column (reward auto picks by it)", "agent_name": "a data column (the agent loop a row runs)"}

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"(?:^|&&|\||\$ )\s*trellis ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", re.M)  # where a shell command starts
KEY_VALUE = re.compile(r"(?<![\w./-])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)=")


def code_of(text: str) -> list[tuple[int, str]]:
    """(line number, code) for every fenced block line, indented (4 spaces) line and inline code span;
    a backslash-continued command is one entry."""
    fenced = set()
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start()) + 1
        fenced.update(range(first, first + block.group().count("\n") + 1))
    found, lines = [], text.splitlines()
    for number, line in enumerate(lines, 1):
        if number in fenced or line.startswith("    "):
            found.append((number, line))
        else:
            found.extend((number, span) for span in SPAN.findall(line))
    joined: list[list] = []  # [first line, last line, code]
    for number, code in found:
        if joined and joined[-1][2].endswith("\\") and joined[-1][1] == number - 1:
            joined[-1][1:] = [number, joined[-1][2][:-1] + " " + code.strip()]
        else:
            joined.append([number, number, code])
    return [(first, code) for first, _, code in joined]


def documented() -> list[tuple[str, int, str]]:
    """(document, line, code) over README.md and docs/*.md."""
    return [(str(p.relative_to(ROOT)), n, c) for p in DOCS for n, c in code_of(p.read_text(encoding="utf-8"))]


def cli_commands() -> dict[str, set[str]]:
    """Each ``trellis`` command and its own subcommands (empty when it has none), from the parser."""
    commands: dict[str, set[str]] = {}
    for action in build_parser()._subparsers._group_actions:
        for name, sub in action.choices.items():
            subs = [a for a in sub._actions if isinstance(a, type(action))]
            commands[name] = set(subs[0].choices) if subs else set()
    return commands


def test_every_documented_trellis_command_exists():
    commands = cli_commands()
    assert {"config", "eval", "make-tiny-model", "plot", "export"} <= set(commands) and commands["config"] == {"show", "init", "from-verl"}
    missing, seen = [], 0
    for doc, line, code in documented():
        for match in COMMAND.finditer(code):
            command, sub = match.groups()
            seen += 1
            if command not in commands:
                missing.append(f"{doc}:{line}: trellis {command} (commands: {', '.join(sorted(commands))})")
            elif commands[command] and sub not in commands[command]:
                missing.append(f"{doc}:{line}: trellis {command} {sub} (subcommands: {', '.join(sorted(commands[command]))})")
    assert not missing, "\n".join(missing)
    assert seen > 50  # the docs' commands were found at all


def every_command() -> set[str]:
    """``train``, ``config show``, ...: each command, or each subcommand of one that has them."""
    return {f"{c} {s}" if s else c for c, subs in cli_commands().items() for s in (sorted(subs) or [""])}


def test_the_cli_lists_name_every_command():
    readme = (ROOT / "packages/core/README.md").read_text(encoding="utf-8")
    block = re.search(r"^```\n(pip install .*?)^```", readme, re.M | re.S).group(1)
    commands = cli_commands()
    listed = {f"{c} {s}" if commands.get(c) else c for c, s in (m.groups() for m in COMMAND.finditer(block))}
    assert listed == every_command(), "packages/core/README.md's command list"
    architecture = (ROOT / "docs/architecture.md").read_text(encoding="utf-8")
    sentence = re.search(r"Core's CLI commands are (.*?)\.\n", architecture, re.S).group(1)  # and the packages'
    named = {s.removeprefix("trellis ") for s in SPAN.findall(sentence)}
    assert named == every_command(), "docs/architecture.md's list of CLI commands"


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


@pytest.fixture(scope="module")
def schemas(registry):
    return {r: recipe_schema(OmegaConf.create({"recipe": r}), registry) for r in RECIPES}


def uninstalled_sources() -> list[Path]:
    """The source files of this repository's packages that are not installed here."""
    files = []
    for project in sorted(ROOT.glob("packages/*/pyproject.toml")):
        name = re.search(r'^name = "([^"]+)"', project.read_text(), re.M).group(1)
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            files += sorted((project.parent / "src").rglob("*.py"))
    return files


def declared_in(files: list[Path], option: str) -> bool:
    """Whether a dataclass-style field ``option: type`` is declared in one of ``files``."""
    field = re.compile(rf"^    {re.escape(option)}: ", re.M)
    return any(field.search(f.read_text(encoding="utf-8")) for f in files)


def key_exists(schema: type, parts: list[str], registry, uninstalled: list[Path]) -> bool:
    """Whether ``parts`` (a dotted key split) is a key of ``schema``: sections descend, a component
    field takes ``name`` and the options of any component of its kind, a free mapping takes anything."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    head, rest = parts[0], parts[1:]
    if head not in fields:
        return False
    if not rest:
        return True
    kind, hint = fields[head].metadata.get(COMPONENT_KIND), typing.get_type_hints(schema)[head]
    if kind is not None:
        if rest == ["name"]:
            return True
        options = [registry.get(kind, n).options for n in registry.names(kind)]
        return any(o is not None and key_exists(o, rest, registry, uninstalled) for o in options) or (
            len(rest) == 1 and declared_in(uninstalled, rest[0])
        )
    if dataclasses.is_dataclass(hint):
        return key_exists(hint, rest, registry, uninstalled)
    return typing.get_origin(hint) is dict or hint is dict


def test_every_documented_config_key_exists(registry, schemas):
    sections = {f.name for s in schemas.values() for f in dataclasses.fields(s)}
    uninstalled = uninstalled_sources()
    unknown, used, seen = [], set(), 0
    for doc, line, code in documented():
        if "from-verl" in code:  # its arguments are verl's keys
            continue
        for key in KEY_VALUE.findall(code):
            if key.split(".")[0] not in sections:  # not a config key (verl's, Python's...)
                continue
            seen += 1
            if (doc, key) in ALLOWED:
                used.add((doc, key))
            elif not any(key_exists(s, key.split("."), registry, uninstalled) for s in schemas.values()):
                unknown.append(f"{doc}:{line}: {key}")
    assert not unknown, "keys no recipe has:\n" + "\n".join(unknown)
    assert used == set(ALLOWED), f"allowed but no longer in the docs: {sorted(set(ALLOWED) - used)}"
    assert seen > 40


def config_tables() -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(document, recipe, rows of (section cell, fields cell)) for each ``| section | fields |`` table;
    the recipe is the one the paragraph before the table names (``The `rl` config``)."""
    tables = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for table in re.finditer(r"^\| section \| fields \|\n\|[-| ]+\|\n((?:\|.*\|\n)+)", text, re.M):
            recipe = re.findall(r"The `(\w+)` config", text[: table.start()])[-1]
            rows = [tuple(c.strip() for c in row.strip("|").split(" | ", 1)) for row in table.group(1).splitlines()]
            tables.append((str(path.relative_to(ROOT)), recipe, rows))
    return tables


def names_under(schema: type, registry) -> set[str]:
    """Every field name in ``schema`` at any depth and the values of its choice fields, component
    options of every installed component included."""
    names = set()
    for f in dataclasses.fields(schema):
        names |= {f.name, *(field_choices(f).values if field_choices(f) else ())}
        kind, hint = f.metadata.get(COMPONENT_KIND), typing.get_type_hints(schema)[f.name]
        nested = [registry.get(kind, n).options for n in registry.names(kind)] if kind else [hint]
        nested += list(typing.get_args(hint))  # list[X] of option dataclasses
        for sub in nested:
            if sub is not None and dataclasses.is_dataclass(sub):
                names |= names_under(sub, registry)
    return names


def test_the_config_tables_list_every_section_and_only_real_fields(registry, schemas):
    tables = config_tables()
    assert [(doc, recipe) for doc, recipe, _ in tables] == [("docs/config.md", "rl"), ("docs/reward-models.md", "rm")]
    words = {n for kind in registry.kinds() for n in registry.names(kind)} | set(registry.kinds()) | set(NOT_FIELDS)
    for doc, recipe, rows in tables:
        schema = schemas[recipe]
        fields = {f.name: f for f in dataclasses.fields(schema)}
        listed = [s for cell, _ in rows for s in SPAN.findall(cell)]
        assert sorted(listed) == sorted(fields), f"{doc}: the {recipe} table's sections differ from the config's"
        for cell, described in rows:
            under = set()
            for section in SPAN.findall(cell):
                hint = typing.get_type_hints(schema)[section]
                under |= names_under(hint, registry) if dataclasses.is_dataclass(hint) else set()
                kind = fields[section].metadata.get(COMPONENT_KIND)
                for name in registry.names(kind) if kind else []:
                    options = registry.get(kind, name).options
                    under |= names_under(options, registry) if options else set()
            for word in SPAN.findall(described):
                if re.fullmatch(r"[a-z_]+", word):
                    assert word in under | words, f"{doc}: the {recipe} table names `{word}` under {cell}; no such field or component"
