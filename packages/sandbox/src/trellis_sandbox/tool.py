"""The ``code_interpreter`` tool: the model sends code, gets back what it printed (stdout, stderr, exit)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from trellis import Tool, ToolResult, ranged
from trellis_sandbox.api import FINISHED, SANDBOX_ERROR, TIME_LIMIT, RunRequest
from trellis_sandbox.client import get_client
from trellis_sandbox.testcases import extract_code


@dataclass
class CodeInterpreterOptions:
    """url: the Sandbox Fusion server (its token, if any, comes from ``TRELLIS_SANDBOX_TOKEN``).
    max_output_chars: stdout and stderr are each cut to this many characters, with a marker saying
    how many were dropped. max_concurrency: the run-wide limit (must match the reward's when both
    use one server)."""

    url: Optional[str] = None  # noqa: UP045 (omegaconf needs typing.Optional on Python 3.10)
    language: str = "python"
    run_timeout: float = ranged(10.0, gt=0)
    compile_timeout: float = ranged(10.0, gt=0)
    memory_limit_mb: int = ranged(1024, gt=0)
    max_output_chars: int = ranged(2000, ge=0)
    max_concurrency: int = ranged(32, ge=1)


class CodeInterpreterTool(Tool):
    """Runs the ``code`` argument in the sandbox; one sample's calls are counted in its state."""

    schema = {
        "type": "function",
        "function": {
            "name": "code_interpreter",
            "description": "Run a program and see its stdout, stderr and exit code.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the program's source code"}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, options: CodeInterpreterOptions | None = None) -> None:
        super().__init__(options or CodeInterpreterOptions())
        if self.options.url is None:
            raise ValueError("tool code_interpreter needs the server's address: set its option url=http://HOST:PORT (e.g. `trellis-sandbox serve`)")
        self.client = get_client(self.options.url, self.options.max_concurrency)
        self.calls: dict[str, int] = {}

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        self.calls[instance_id] = 0

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        opts = self.options
        code = arguments.get("code") if isinstance(arguments, dict) else None
        if not isinstance(code, str) or not code.strip():
            return ToolResult("Error: call code_interpreter with a non-empty string argument 'code'.", metrics={"tool/bad_call": 1.0})
        self.calls[instance_id] = self.calls.get(instance_id, 0) + 1
        req = RunRequest(extract_code(code, opts.language), opts.language, opts.compile_timeout, opts.run_timeout, opts.memory_limit_mb)
        resp = await self.client.run(req)
        comp, run = resp.compile_result, resp.run_result
        if comp is not None and (comp.status != FINISHED or comp.return_code != 0):
            text = "Compilation failed.\n" + _section("stderr", comp.stderr, opts.max_output_chars)
            return ToolResult(text, metrics={"tool/compile_error": 1.0})
        if resp.status == SANDBOX_ERROR or run is None:
            return ToolResult(f"Error: the sandbox could not run the code: {resp.message}", metrics={"tool/sandbox_error": 1.0})
        head = f"Timed out after {opts.run_timeout:g} s." if run.status == TIME_LIMIT else f"Exit code {run.return_code}."
        text = "\n".join([head, _section("stdout", run.stdout, opts.max_output_chars), _section("stderr", run.stderr, opts.max_output_chars)])
        ok = run.status == FINISHED and run.return_code == 0
        return ToolResult(text.rstrip("\n"), metrics={"tool/ok": float(ok), "tool/run_s": float(run.execution_time or 0.0)})

    async def release(self, instance_id: str) -> None:
        self.calls.pop(instance_id, None)


def _section(name: str, text: str | None, limit: int) -> str:
    text = text or ""
    if len(text) > limit:
        text = text[:limit] + f"\n...[{len(text) - limit} more characters cut]"
    return f"{name}:\n{text}" if text else f"{name}: (empty)"
