"""The Hermes tool-call parser (kind ``tool_parser``, name ``hermes``): the function calls in a model turn's text."""

from __future__ import annotations

import json
import re

from trellis import ToolCall, ToolCallParser

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesParser(ToolCallParser):
    """Hermes / Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
    number per turn. A block that is not such JSON becomes a call with ``error`` set, so the model
    is told what was wrong instead of being ignored."""

    def parse(self, text: str) -> list[ToolCall]:
        return [_parse_one(block.strip()) for block in _HERMES.findall(text)]

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """A block that does not parse stays in the text, where the agent can read it."""
        calls, kept, at = [], [], 0
        for match in _HERMES.finditer(text):
            call = _parse_one(match.group(1).strip())
            if call.error is None:
                calls.append(call)
                kept.append(text[at : match.start()])
                at = match.end()
        kept.append(text[at:])
        return "".join(kept).strip(), calls


def _parse_one(block: str) -> ToolCall:
    try:
        call = json.loads(block)
    except json.JSONDecodeError as exc:
        return ToolCall("", error=f"the tool call is not valid JSON ({exc.msg} at position {exc.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", error='a tool call must be a JSON object with "name" and "arguments"')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(call["name"], error='"arguments" is a string that is not JSON')
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error='"arguments" must be a JSON object')
    return ToolCall(call["name"], arguments)
