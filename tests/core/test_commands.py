"""Commands plugins add to ``trellis`` (``trellis_add_commands``): a new command and one in the
``config`` group run with their arguments and the loaded plugins; a command added twice, or into
a group that does not exist, is refused naming who added it; a command whose package moved out of
core and is not installed names the package."""

from __future__ import annotations

import importlib.util
import re

import pytest
from cli_runs import run_cli as trellis

import trellis as sdk
from trellis.cli import all_commands
from trellis.plugins import load_plugins
from trellis.registry import RegistryError


def greet(args) -> int:
    print(f"hello {args.who} from {len(args.plugins.infos)} plugins")
    return 0


def controllers(args) -> int:
    print(" ".join(args.plugins.registry.names("controller")))
    return 0


class Greeter:
    @sdk.hookimpl
    def trellis_add_commands(self, commands):
        commands.add("greet", greet, help="say hello").add_argument("who")
        commands.add("config controllers", controllers, help="list the installed controllers")


class Again:
    @sdk.hookimpl
    def trellis_add_commands(self, commands):
        commands.add("greet", controllers, help="another greet")


class NoGroup:
    @sdk.hookimpl
    def trellis_add_commands(self, commands):
        commands.add("serve status", greet, help="a command in a group nobody made")


def run(plugin, *argv: str) -> int:
    commands = all_commands(load_plugins(extra=[("plugin", plugin)], entry_points=False))
    args = commands.parser.parse_args(argv)
    args.plugins = load_plugins(entry_points=False)
    return args.func(args)


def test_a_plugin_adds_a_command_and_a_config_subcommand(capsys):
    assert run(Greeter(), "greet", "ana") == 0
    assert capsys.readouterr().out == "hello ana from 1 plugins\n"
    assert run(Greeter(), "config", "controllers") == 0
    assert capsys.readouterr().out.split() == ["local"]  # core's own controller (ray: trellis-ray)
    help_text = all_commands(load_plugins(extra=[("plugin", Greeter())], entry_points=False)).parser.format_help()
    assert "greet" in help_text and "say hello" in help_text


def test_a_command_added_twice_names_both_modules():
    here = re.escape(__name__)
    with pytest.raises(RegistryError, match=f"trellis command 'greet' is added twice: by {here} and by {here}; uninstall one"):
        all_commands(load_plugins(extra=[("one", Greeter()), ("two", Again())], entry_points=False))
    with pytest.raises(RegistryError, match=r"trellis command 'train' is added twice: by trellis\.cli and by"):

        class Train:
            @sdk.hookimpl
            def trellis_add_commands(self, commands):
                commands.add("train", greet, help="a second train")

        all_commands(load_plugins(extra=[("train", Train())], entry_points=False))


def test_a_command_in_a_missing_group_names_the_groups():
    here = re.escape(__name__)
    with pytest.raises(RegistryError, match=rf"trellis command 'serve status' \({here}\) names no command group 'serve'; groups: config"):
        all_commands(load_plugins(extra=[("plugin", NoGroup())], entry_points=False))


@pytest.mark.skipif(importlib.util.find_spec("trellis_verl_compat") is not None, reason="trellis-verl-compat is installed")
def test_a_moved_command_names_its_package(tmp_path):
    done = trellis("config", "from-verl", "algorithm.adv_estimator=grpo", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "trellis: error: `trellis config from-verl` comes with the trellis-verl-compat package, which is not installed: "
        "pip install trellis-verl-compat"
    )


def test_the_cli_keeps_http_client_request_lines_out_of_the_log():
    """An agent's OpenAI client (httpx) logged one INFO line per model call of every sample; the
    CLI's own INFO lines stay (a fresh process: pytest configures logging its own way)."""
    import subprocess
    import sys

    code = (
        "import logging\nfrom trellis.cli import main\nmain(['plugins'])\n"
        "print(logging.getLogger('httpx').isEnabledFor(logging.INFO), logging.getLogger('trellis').isEnabledFor(logging.INFO))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == "False True", done.stderr[-2000:]
