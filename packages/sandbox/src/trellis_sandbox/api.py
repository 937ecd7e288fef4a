"""The Sandbox Fusion ``/run_code`` request and response, as plain dataclasses shared by client and server.

Request fields (JSON): ``code`` (required), ``language`` (required), ``compile_timeout`` and
``run_timeout`` (seconds), ``memory_limit_MB``, ``stdin``, ``files`` (path -> base64 content, written
into the work dir before the run) and ``fetch_files`` (paths read back after it, base64).
Response: ``status`` ``Success`` (every step exited 0) / ``Failed`` (a step did not) / ``SandboxError``
(the sandbox itself failed), ``message``, ``compile_result`` and ``run_result`` (each ``status``
``Finished`` / ``Error`` / ``TimeLimitExceeded``, ``execution_time``, ``return_code``, ``stdout``,
``stderr``) and ``files``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SUCCESS, FAILED, SANDBOX_ERROR = "Success", "Failed", "SandboxError"
FINISHED, ERROR, TIME_LIMIT = "Finished", "Error", "TimeLimitExceeded"


class RequestError(ValueError):
    """A ``/run_code`` body that cannot be run; the message names the field, the value and the fix."""


@dataclass
class RunRequest:
    code: str
    language: str
    compile_timeout: float = 10.0
    run_timeout: float = 10.0
    memory_limit_MB: int | None = None  # noqa: N815 (the API's spelling); None = the server's default
    stdin: str | None = None
    files: dict[str, str | None] = field(default_factory=dict)
    fetch_files: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        if body["memory_limit_MB"] is None:
            del body["memory_limit_MB"]
        return body

    @classmethod
    def from_json(cls, body: Any, *, max_timeout: float) -> RunRequest:
        """Checks every field; raises :class:`RequestError` naming the first bad one."""
        if not isinstance(body, dict):
            raise RequestError(f"the body is JSON {type(body).__name__}, not an object; send {{'code': ..., 'language': ...}}")
        unknown = sorted(set(body) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise RequestError(f"unknown field(s) {unknown}; the fields are {sorted(cls.__dataclass_fields__)}")
        for name in ("code", "language"):
            if name not in body:
                raise RequestError(f"missing field {name!r}; a request needs 'code' and 'language'")
            _expect(name, body[name], str, "a string")
        req = cls(code=body["code"], language=body["language"])
        for name in ("compile_timeout", "run_timeout"):
            if body.get(name) is not None:
                value = body[name]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= max_timeout:
                    raise RequestError(f"{name}={value!r}; give seconds as a number in (0, {max_timeout:g}]")
                setattr(req, name, float(value))
        if body.get("memory_limit_MB") is not None:
            value = body["memory_limit_MB"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 16 <= value <= 1 << 20:
                raise RequestError(f"memory_limit_MB={value!r}; give megabytes as a number, at least 16")
            req.memory_limit_MB = int(value)
        if body.get("stdin") is not None:
            req.stdin = _expect("stdin", body["stdin"], str, "a string")
        files = body.get("files") or {}
        _expect("files", files, dict, "an object of path -> base64 content")
        for path, content in files.items():
            if content is not None:
                _expect(f"files[{path!r}]", content, str, "base64 text")
        req.files = dict(files)
        fetch = body.get("fetch_files") or []
        _expect("fetch_files", fetch, list, "a list of paths")
        for path in fetch:
            _expect("fetch_files[]", path, str, "a path string")
        req.fetch_files = list(fetch)
        return req


@dataclass
class CommandResult:
    status: str
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


@dataclass
class RunResponse:
    status: str
    message: str = ""
    compile_result: CommandResult | None = None
    run_result: CommandResult | None = None
    files: dict[str, str] = field(default_factory=dict)
    executor_pod_name: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RunResponse:
        def command(part: Any) -> CommandResult | None:
            if not part:
                return None
            return CommandResult(**{k: part.get(k) for k in CommandResult.__dataclass_fields__})

        return cls(
            status=body["status"],
            message=body.get("message") or "",
            compile_result=command(body.get("compile_result")),
            run_result=command(body.get("run_result")),
            files=body.get("files") or {},
        )


def _expect(name: str, value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise RequestError(f"{name}={str(value)[:60]!r} is {type(value).__name__}; give {what}")
    return value
