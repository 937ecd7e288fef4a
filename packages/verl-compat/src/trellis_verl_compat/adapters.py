"""The class adapter ``verl``: interactions and tools written for verl (``BaseInteraction`` /
``BaseTool`` method names and return shapes), named by a ``multi_turn`` entry's ``verl_class``, run
unchanged, without importing verl."""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from trellis import Interaction, InteractionTurn, Tool, ToolResult


def import_class(path: str, key: str) -> type:
    """The class ``package.module.Class`` names; errors name the config ``key``."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"config key {key!r} is {path!r}; give a class path such as my_package.my_module.MyInteraction")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"config key {key!r}: cannot import module {module_name!r} ({exc}); is its package installed?") from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ValueError(f"config key {key!r}: module {module_name!r} has no class {name!r}")
    return cls


class VerlClasses:
    """Class adapter ``verl`` (``trellis.interfaces.agents.ClassAdapter``): what core builds for a
    ``verl_class`` entry of ``multi_turn.interactions`` or ``multi_turn.tools``."""

    def interaction(self, path: str, options: dict[str, Any], name: str, key: str) -> Callable[[], Interaction]:
        return functools.partial(VerlInteraction, import_class(path, key), options, name)

    def tool(self, path: str, options: dict[str, Any], schema: dict[str, Any], key: str) -> Callable[[], Tool]:
        return functools.partial(VerlTool, import_class(path, key), options, schema)

    def start_needs(self, path: str) -> tuple[str, ...]:
        """``name`` (verl's agent loop requires it in every row) and ``start_interaction``'s keyword
        parameters without a default."""
        params = list(inspect.signature(import_class(path, "").start_interaction).parameters.values())[2:]  # self, instance_id
        return ("name", *(p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)))


class VerlInteraction(Interaction):
    """A verl interaction: ``start_interaction``, ``generate_response -> (done, text, score,
    extra)``, ``finalize_interaction``."""

    def __init__(self, cls: type, config: dict[str, Any], name: str) -> None:
        super().__init__(config)
        self.inner = cls({"name": name, **config})

    async def start(self, instance_id: str, **kwargs: Any) -> None:
        await self.inner.start_interaction(instance_id, **kwargs)

    async def respond(self, instance_id: str, messages: list[dict[str, str]]) -> InteractionTurn:
        done, text, score, extra = await self.inner.generate_response(instance_id, messages)
        return InteractionTurn(bool(done), "" if text is None else str(text), float(score or 0.0), _numbers(extra))

    async def finalize(self, instance_id: str) -> None:
        # verl's base class takes no instance id; its GSM8K interaction does
        if _takes_arguments(self.inner.finalize_interaction):
            await self.inner.finalize_interaction(instance_id)
        else:
            await self.inner.finalize_interaction()


class VerlTool(Tool):
    """A verl tool: ``create``, ``execute -> (response, reward, metrics)`` (the response a string,
    a dict with ``text`` or an object with ``.text``), ``release``."""

    def __init__(self, cls: type, config: dict[str, Any], schema: dict[str, Any]) -> None:
        super().__init__(config)
        self.schema = schema
        self.inner = cls(config, _Schema(schema))

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        await self.inner.create(instance_id, **kwargs)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        response, reward, metrics = await self.inner.execute(instance_id, arguments)
        return ToolResult(_text(response), float(reward or 0.0), _numbers(metrics))

    async def release(self, instance_id: str) -> None:
        await self.inner.release(instance_id)


class _Schema:
    """What verl's tools read of their ``OpenAIFunctionToolSchema``: attributes all the way
    down (``schema.function.name``) and ``model_dump()``."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data
        for key, value in data.items():
            setattr(self, key, _Schema(value) if isinstance(value, dict) else value)

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return self._data


def _text(response: Any) -> str:
    if isinstance(response, str):
        return response
    if isinstance(response, dict):
        return str(response.get("text", ""))
    return str(getattr(response, "text", "") or "")


def _numbers(extra: Any) -> dict[str, float]:
    if not isinstance(extra, dict):
        return {}
    return {k: float(v) for k, v in extra.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _takes_arguments(fn: Any) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)
