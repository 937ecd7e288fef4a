"""Runs one ``/run_code`` request: a private work dir, compile and run inside the isolation, with rlimits,
a wall timeout and capped output; then every process and file of the run is removed."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import ctypes
import functools
import logging
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from trellis_sandbox.api import ERROR, FAILED, FINISHED, SUCCESS, TIME_LIMIT, CommandResult, RequestError, RunRequest, RunResponse
from trellis_sandbox.isolation import Isolation, as_user
from trellis_sandbox.languages import Language

logger = logging.getLogger("trellis.sandbox")

READ_CHUNK = 1 << 16
DRAIN_GRACE_S = 1.0  # after the run's process ended, how long its pipes may stay open
CLEAN_GRACE_S = 0.5  # after that, how long the sandbox's last processes may take to exit
PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>


@dataclass(frozen=True)
class Limits:
    """Per-process rlimits of one run: set on its own processes only (bwrap and the program, or the
    program alone without bwrap), never on the server."""

    memory_mb: int
    cpu_s: int
    nproc: int
    fsize_mb: int
    nofile: int

    def prlimit(self) -> tuple[str, ...]:
        return (
            "prlimit",
            f"--as={self.memory_mb << 20}",
            f"--cpu={self.cpu_s}",
            f"--nproc={self.nproc}",
            f"--fsize={self.fsize_mb << 20}",
            f"--nofile={self.nofile}",
            "--core=0",
            "--",
        )


@dataclass(frozen=True)
class RunnerConfig:
    """memory_mb: the address-space limit when a request names none (clients often drop it).
    compile_memory_mb: the compiler's. output_cap: bytes kept of stdout and of stderr each; a program
    that writes more is stopped and the text says it was truncated. uid_base: when root, slot i runs as
    uid ``uid_base + i``."""

    memory_mb: int = 1024
    compile_memory_mb: int = 2048
    nproc: int = 64
    fsize_mb: int = 64
    nofile: int = 256
    output_cap: int = 1 << 20
    fetch_cap: int = 16 << 20
    uid_base: int = 61000


class Runner:
    """Executes requests in ``root`` (a folder only the server may list), one work dir per run."""

    def __init__(self, isolation: Isolation, languages: dict[str, Language], root: Path, config: RunnerConfig) -> None:
        self.isolation = isolation
        self.languages = languages
        self.root = root
        self.config = config
        self.as_root = os.geteuid() == 0
        self._counter = 0
        if self.as_root:
            _become_subreaper()
        self.leftovers_killed = 0

    def uid(self, slot: int) -> int | None:
        return self.config.uid_base + slot if self.as_root else None

    def check(self, req: RunRequest) -> None:
        """Raises :class:`RequestError` for what can be refused before anything runs."""
        if req.language not in self.languages:
            raise RequestError(f"language={req.language!r} is not run by this server; use one of {sorted(self.languages)}")
        for path in [*req.files, *req.fetch_files]:
            _relative(path)

    async def execute(self, req: RunRequest, slot: int) -> RunResponse:
        self._counter += 1
        run_dir = self.root / f"run-{self._counter}"
        work, stage = run_dir / "work", run_dir / "stage"
        try:
            self._prepare(req, run_dir, work, stage, self.uid(slot))
            return await self._compile_and_run(req, work, stage, slot)
        finally:
            await self._clean(slot)
            shutil.rmtree(run_dir, ignore_errors=True)

    def _prepare(self, req: RunRequest, run_dir: Path, work: Path, stage: Path, uid: int | None) -> None:
        lang = self.languages[req.language]
        run_dir.mkdir(mode=0o711)
        for d in (work, stage):
            d.mkdir(mode=0o700)
        (work / lang.source).write_text(req.code)
        for path, content in req.files.items():
            if content is None:
                continue
            target = work / _relative(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                target.write_bytes(base64.b64decode(content, validate=True))
            except binascii.Error as exc:
                raise RequestError(f"files[{path!r}] is not base64 ({exc}); send the file's bytes base64-encoded") from None
        if uid is not None:
            for folder, _, names in os.walk(work):
                os.chown(folder, uid, uid)
                for name in names:
                    os.chown(os.path.join(folder, name), uid, uid)
            os.chown(stage, uid, uid)

    async def _compile_and_run(self, req: RunRequest, work: Path, stage: Path, slot: int) -> RunResponse:
        lang = self.languages[req.language]
        cfg = self.config
        compile_result = None
        if lang.compile is not None:
            memory = max(cfg.compile_memory_mb, req.memory_limit_MB or 0)
            limits = Limits(memory, math.ceil(req.compile_timeout) + 1, cfg.nproc, cfg.fsize_mb, cfg.nofile)
            compile_result = await self._command(list(lang.compile), work, stage, slot, limits, None, req.compile_timeout)
            if compile_result.status != FINISHED or compile_result.return_code != 0:
                return RunResponse(FAILED, "compilation failed", compile_result=compile_result)
        limits = Limits(req.memory_limit_MB or cfg.memory_mb, math.ceil(req.run_timeout) + 1, cfg.nproc, cfg.fsize_mb, cfg.nofile)
        run_result = await self._command(list(lang.run), work, stage, slot, limits, req.stdin, req.run_timeout)
        ok = run_result.status == FINISHED and run_result.return_code == 0
        files = self._fetch(work, req.fetch_files)
        return RunResponse(SUCCESS if ok else FAILED, "" if ok else _explain(run_result), compile_result, run_result, files)

    async def _command(self, argv: list[str], work: Path, stage: Path, slot: int, limits: Limits, stdin: str | None, timeout: float) -> CommandResult:
        cmd = as_user(self.isolation.wrap(argv, work, stage, limits.prlimit()), self.uid(slot))
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # one process group to kill, whatever the program does
            cwd=work,
            env=self.isolation.launcher_env(),
        )
        over_cap = asyncio.Event()
        outs = [_Capture(self.config.output_cap, over_cap), _Capture(self.config.output_cap, over_cap)]
        readers = [asyncio.create_task(c.read(s)) for c, s in zip(outs, (proc.stdout, proc.stderr))]
        feeder = asyncio.create_task(_feed(proc.stdin, stdin))
        waiter = asyncio.create_task(proc.wait())
        capped = asyncio.create_task(over_cap.wait())
        done, _ = await asyncio.wait({waiter, capped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        elapsed = time.monotonic() - start
        timed_out = not done
        _kill_group(proc.pid)
        await waiter
        capped.cancel()
        _, pending = await asyncio.wait([*readers, feeder], timeout=DRAIN_GRACE_S)
        for task in pending:
            task.cancel()
        status = TIME_LIMIT if timed_out else ERROR if over_cap.is_set() else FINISHED
        return CommandResult(
            status=status,
            execution_time=round(elapsed, 6),
            return_code=None if timed_out else proc.returncode,
            stdout=outs[0].text("stdout"),
            stderr=outs[1].text("stderr"),
        )

    def _fetch(self, work: Path, paths: list[str]) -> dict[str, str]:
        files, budget = {}, self.config.fetch_cap
        for path in paths:
            target = work / _relative(path)
            if target.is_file() and not target.is_symlink() and target.stat().st_size <= budget:
                data = target.read_bytes()
                budget -= len(data)
                files[path] = base64.b64encode(data).decode()
        return files

    async def _clean(self, slot: int) -> None:
        """Reaps the run's orphans and kills any process still owned by the slot's uid once a short grace
        is over: the sandbox's own PID 1 may still be exiting when its parent has; anything past that was
        left behind."""
        uid = self.uid(slot)
        if uid is None:
            return
        live, dead = _processes_of(uid)
        if live:
            await _exits(live, time.monotonic() + CLEAN_GRACE_S)
            live, dead = _processes_of(uid)
        for pid in dead:
            with contextlib.suppress(ChildProcessError):  # not an orphan handed to this server
                os.waitpid(pid, os.WNOHANG)
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
                self.leftovers_killed += 1
                logger.warning("killed process %d of uid %d left behind by a run", pid, uid)
            except ProcessLookupError:
                pass


class _Capture:
    """Keeps the first ``cap`` bytes of a stream and counts the rest; sets ``over`` once past ``cap``."""

    def __init__(self, cap: int, over: asyncio.Event) -> None:
        self.cap, self.over = cap, over
        self.data = bytearray()
        self.total = 0

    async def read(self, stream: asyncio.StreamReader) -> None:
        # Reads to the end even past the cap: asyncio reports the process's exit only once its pipes close.
        while chunk := await stream.read(READ_CHUNK):
            self.data += chunk[: self.cap - len(self.data)]
            self.total += len(chunk)
            if self.total > self.cap:
                self.over.set()

    def text(self, name: str) -> str:
        text = self.data.decode("utf-8", errors="replace")
        if self.total > self.cap:
            text += f"\n[trellis-sandbox: {name} truncated: the program wrote more than {self.cap} bytes, so it was stopped]"
        return text


async def _feed(stdin: asyncio.StreamWriter, data: str | None) -> None:
    try:
        if data:
            stdin.write(data.encode())
            await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program exited without reading all of its input


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _become_subreaper() -> None:
    """Makes this server the parent of its runs' orphans. bwrap's PID 1 inside the sandbox outlives the
    process the server waits on by a moment, so it used to go to the machine's init as a zombie; where
    init reaps lazily they piled up (dozens per slot uid under load), and every clean-up scan read each
    one's state. Now ``_clean`` reaps them at once."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(err)}")


@functools.cache
def pidfds_work() -> bool:
    """Whether this kernel has pidfds (Linux 5.3 on)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


async def _exits(pids: list[int], deadline: float) -> None:
    """Returns once every process of ``pids`` has exited or at ``deadline``. Each is watched through a pidfd,
    so the wait ends at the exit itself: polling /proc every 5 ms left a slot idle ~2 ms per run on average
    (still the way on kernels without pidfds)."""
    loop = asyncio.get_running_loop()
    for pid in pids:
        if not pidfds_work():
            while _running(pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            continue
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        exited = loop.create_future()
        loop.add_reader(fd, _settle, exited)  # readable from the exit on
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(exited, max(0.0, deadline - time.monotonic()))
        finally:
            loop.remove_reader(fd)
            os.close(fd)


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _processes_of(uid: int) -> tuple[list[int], list[int]]:
    """The live and the zombie processes of ``uid``."""
    live, dead = [], []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    (dead if _state(entry.name) == ord("Z") else live).append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return live, dead


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        return _state(str(pid)) != ord("Z")
    except (FileNotFoundError, ProcessLookupError):
        return False


def _state(pid: str) -> int:
    """The state letter's byte in /proc/PID/stat (read raw: this runs for every process of a slot after every run)."""
    fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    try:
        stat = os.read(fd, 4096)
    finally:
        os.close(fd)
    return stat[stat.rindex(b")") + 2]


def _relative(path: str) -> PurePosixPath:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise RequestError(f"file path {path!r} leaves the work dir; give a relative path without '..'")
    return p


def _explain(result: CommandResult) -> str:
    if result.status == TIME_LIMIT:
        return "the program ran past run_timeout"
    if result.status == ERROR:
        return "the program's output passed the server's cap"
    return f"the program exited with code {result.return_code}"
