"""Environment classes: tool schemas read from signatures and docstrings (checked by hand), and
every class the adapter refuses, refused with the key, the method and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import pytest

from trellis.config import ConfigError
from trellis_multiturn.checks import check_reset_fields
from trellis_multiturn.environment_class import describe_environment, json_schema, parse_docstring

ENVIRONMENTS = Path(__file__).parents[1] / "environments.py"
HERE = Path(__file__)


def test_schemas_come_from_signatures_and_docstrings():
    env = describe_environment(f"{ENVIRONMENTS}:GuessSum")
    guess = {
        "type": "function",
        "function": {
            "name": "guess",
            "description": "Guess the sum; the answer says whether it is right, higher or lower.",
            "parameters": {
                "type": "object",
                "properties": {"number": {"type": "integer", "description": "the guessed sum, a whole number."}},
                "required": ["number"],
            },
        },
    }
    hint = {
        "type": "function",
        "function": {
            "name": "hint",
            "description": "A hint about the sum.",
            "parameters": {
                "type": "object",
                "properties": {
                    "kind": {"type": "string", "enum": ["parity", "size"], "description": "parity (even or odd) or size (how many digits)."},
                    "digits": {"type": ["array", "null"], "items": {"type": "integer"}, "description": "digits to ask about; all when omitted."},
                },
                "required": ["kind"],
            },
        },
    }
    assert env.schemas == (guess, hint)  # reset and reward are not tools
    assert env.reset_fields == ("question", "noisy") and env.reset_needs == ("question",) and env.rewarded


def test_json_schemas_of_the_types_a_tool_takes():
    assert json_schema(float) == {"type": "number"} and json_schema(bool) == {"type": "boolean"} and json_schema(list) == {"type": "array"}
    assert json_schema(list[str]) == {"type": "array", "items": {"type": "string"}}
    assert json_schema(Optional[Literal[1, 2]]) == {"type": ["integer", "null"], "enum": [1, 2, None]}  # noqa: UP045 (the spelling under test)
    assert json_schema(str | None) == {"type": ["string", "null"]}
    for bad in (dict, dict[str, int], int | str, Literal[1, "a"], tuple[int, int], Optional[dict]):  # noqa: UP045
        with pytest.raises(TypeError):
            json_schema(bad)


def test_docstring_description_and_args():
    doc = "Move the piece.\n\nSee the rules.\n\nArgs:\n    row (int): the row,\n        counted from 0.\n    col: the column.\n\n"
    doc += "Returns:\n    the board."
    assert parse_docstring(doc) == ("Move the piece. See the rules.", {"row": "the row, counted from 0.", "col": "the column."})
    assert parse_docstring("Just a sentence.") == ("Just a sentence.", {})


class NoDocstring:
    def reset(self): ...
    def act(self, x: int) -> str:  # noqa: E301
        return ""


class Unannotated:
    def reset(self): ...
    def act(self, x) -> str:  # noqa: E301
        """Act.

        Args:
            x: what.
        """


class DictParameter:
    def reset(self): ...
    def act(self, x: dict[str, int]) -> str:  # noqa: E301
        """Act.

        Args:
            x: what.
        """


class VarArgs:
    def reset(self): ...
    def act(self, *xs: int) -> str:  # noqa: E301
        """Act.

        Args:
            xs: what.
        """


class Undescribed:
    def reset(self): ...
    def act(self, x: int, y: int) -> str:  # noqa: E301
        """Act.

        Args:
            x: what.
        """


class MisspeltArg:
    def reset(self): ...
    def act(self, count: int) -> str:  # noqa: E301
        """Act.

        Args:
            conut: how many.
        """


class OnlyReset:
    def reset(self): ...
    def reward(self) -> float:  # noqa: E301
        return 1.0

    def _private(self, x: int) -> str: ...  # noqa: E301


class NoReset:
    def act(self, x: int) -> str:
        """Act.

        Args:
            x: what.
        """


class MisspeltReward(NoReset):
    def reset(self): ...
    def rewards(self) -> float:  # noqa: E301
        return 1.0


class NeedsArguments(NoReset):
    def __init__(self, size: int):
        self.size = size

    def reset(self): ...


class Static(NoReset):
    def reset(self): ...
    @staticmethod  # noqa: E301
    def helper(x: int) -> int:
        return x


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("NoDocstring", r"NoDocstring.act has no docstring; it becomes the tool's description"),
        ("Unannotated", r"Unannotated.act's parameter 'x' has no type annotation; annotate it with str, int, float, bool"),
        ("DictParameter", r"DictParameter.act's parameter 'x' has type dict\[str, int\], which a tool schema here cannot express; use str"),
        ("VarArgs", r"VarArgs.act takes 'xs' as variadic positional; a tool's arguments are passed by name"),
        ("Undescribed", r"Undescribed.act's docstring does not describe parameter 'y'; add `y: <what it is>` to its Args: section"),
        ("MisspeltArg", r"MisspeltArg.act's docstring does not describe parameter 'count'"),
        ("OnlyReset", r"OnlyReset has no public methods besides reset and reward, so the model would have no tools"),
        ("NoReset", r"NoReset has no reset method; define reset\(self, \*\*extra_info\)"),
        ("MisspeltReward", r"MisspeltReward.rewards would be a tool; did you mean reward"),
        ("NeedsArguments", r"NeedsArguments\(\) needs size; one object is built per sample with no arguments"),
        ("Static", r"Static.helper is a staticmethod; tools are instance methods"),
        ("test_rows_must_give_what_reset_needs", r"'.*:test_rows_must_give_what_reset_needs' is not a class"),
    ],
)
def test_refused_classes_name_the_key_the_method_and_the_fix(name, message):
    with pytest.raises(ConfigError, match=rf"config key 'multi_turn.environment'.*{message}"):
        describe_environment(f"{HERE}:{name}")


def test_args_naming_no_parameter_is_refused_with_the_closest():
    class Typo:
        def act(self, count: int) -> str:
            """Act.

            Args:
                count: how many.
                cuont: again.
            """

    from trellis_multiturn.environment_class import tool_schema

    with pytest.raises(ConfigError, match=r"Typo.act's docstring describes 'cuont' in Args:, which is not a parameter \(did you mean 'count'\?\)"):
        tool_schema("Typo", Typo.act)


def test_rows_must_give_what_reset_needs():
    rows = [{"extra_info": {"question": "1+2="}}, {"extra_info": {"index": 3}}]
    with pytest.raises(ConfigError, match=r"data.train_path 'x.jsonl': row 1 has no extra_info.question, which multi_turn.environment's reset"):
        check_reset_fields(rows, ("question",), "data.train_path 'x.jsonl'")
    check_reset_fields(rows[:1], ("question",), "data")
