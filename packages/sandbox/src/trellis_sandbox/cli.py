"""``trellis-sandbox serve``: start the local Sandbox Fusion-compatible server.

On loopback it needs no token unless TRELLIS_SANDBOX_TOKEN gives one; on any other address clients
must send ``Authorization: Bearer <token>`` (TRELLIS_SANDBOX_TOKEN, else a fresh token printed at start).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from aiohttp import web

from trellis_sandbox.auth import TOKEN_ENV, Access, client_hint, decide_access
from trellis_sandbox.isolation import IsolationUnavailable, detect
from trellis_sandbox.languages import available_languages, default_python
from trellis_sandbox.runner import Runner, RunnerConfig, pidfds_work
from trellis_sandbox.server import SandboxServer, ServerConfig

SHM = "/dev/shm"
SHM_MIN_FREE = 1 << 30


def scratch_dir() -> str | None:
    """Where the runs' work dirs go: /dev/shm where it is a writable folder with at least
    ``SHM_MIN_FREE`` free (a tmpfs: each run's mkdir, write, chown and rmtree cost ~0.35 ms there
    against ~1.2 ms on this VM's disk, all on the server's one thread; a container's default 64 MB
    /dev/shm would refuse a program's larger files), else the system's temp dir."""
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK | os.X_OK) and shutil.disk_usage(SHM).free >= SHM_MIN_FREE:
        return SHM
    return None


def runs_root() -> Path:
    """A new folder for the runs' work dirs, in :func:`scratch_dir`; the caller removes it."""
    root = Path(tempfile.mkdtemp(prefix="trellis-sandbox-", dir=scratch_dir()))
    os.chmod(root, 0o711)  # the sandbox users may pass through, not list
    return root


def default_workers() -> int:
    """One slot more than the CPUs: each run spends a few ms of its slot off the CPU (its launchers
    starting and exiting, the server answering and setting up the next), and with slots = CPUs those
    gaps left the machine ~12% idle under load. The cost: when every slot runs a CPU-bound program,
    each gets CPUs / (CPUs + 1) of a core, so its wall time (measured against ``run_timeout``)
    stretches by (CPUs + 1) / CPUs."""
    return (os.cpu_count() or 1) + 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trellis-sandbox", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve POST /run_code on HOST:PORT", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; any other address requires a token)"
    )
    s.add_argument("--port", type=int, default=8080, help="port; 0 picks a free one (the URL is printed)")
    s.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="programs run at once (default: the CPU count + 1; give the CPU count where CPU-bound programs' wall times must not stretch)",
    )
    s.add_argument("--queue-size", type=int, default=256, help="requests that may wait for a worker; more get 503")
    s.add_argument("--memory-mb", type=int, default=1024, help="address-space limit when a request gives no memory_limit_MB")
    s.add_argument("--output-cap-kb", type=int, default=1024, help="stdout and stderr kept per run; a program writing more is stopped")
    s.add_argument("--max-timeout", type=float, default=60.0, help="largest compile_timeout / run_timeout accepted (s)")
    s.add_argument("--max-request-mb", type=int, default=16, help="largest request body")
    s.add_argument("--nproc", type=int, default=64, help="processes (and threads) per run")
    s.add_argument("--isolation", choices=["auto", "bwrap", "unshare"], default="auto", help="auto: bubblewrap, else unshare")
    s.add_argument("--unsafe-no-isolation", action="store_true", help="run programs with rlimits only: NEVER for untrusted code")
    s.add_argument(
        "--unsafe-no-token",
        action="store_true",
        help=f"serve without a token even off loopback (ignores {TOKEN_ENV}): NEVER on a network you do not trust",
    )
    s.add_argument("--python", default=None, help="interpreter for language 'python' (default: the system's python3)")
    s.add_argument("--uid-base", type=int, default=61000, help="when root, worker i runs programs as uid UID_BASE+i")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name, value, least in (("--workers", args.workers, 1), ("--queue-size", args.queue_size, 0), ("--output-cap-kb", args.output_cap_kb, 1)):
        if value < least:
            print(f"trellis-sandbox: {name}={value}; give at least {least}", file=sys.stderr)
            return 2
    if not 0 <= args.port <= 65535:
        print(f"trellis-sandbox: --port={args.port}; give a port in 0..65535 (0 picks a free one)", file=sys.stderr)
        return 2
    root = runs_root()
    try:
        as_root = os.geteuid() == 0
        try:
            isolation = detect("none" if args.unsafe_no_isolation else args.isolation, args.uid_base if as_root else None, root)
        except IsolationUnavailable as exc:
            print(f"trellis-sandbox: refusing to start: {exc}", file=sys.stderr)
            return 2
        if isolation.kind == "unshare" and args.isolation == "auto":
            print(
                "trellis-sandbox: note: bubblewrap is not installed, so runs are isolated by unshare, whose set-up execs "
                "four commands per run (about 1.4x bubblewrap's CPU per run: fewer runs/s, longer waits under load); "
                "install it for throughput (Debian/Ubuntu: `apt-get install bubblewrap`)",
                file=sys.stderr,
            )
        if isolation.kind == "none":
            print("trellis-sandbox: WARNING: --unsafe-no-isolation: programs run with rlimits only; never serve untrusted code", file=sys.stderr)
        config = RunnerConfig(memory_mb=args.memory_mb, output_cap=args.output_cap_kb << 10, nproc=args.nproc, uid_base=args.uid_base)
        runner = Runner(isolation, available_languages(args.python or default_python()), root, config)
        access = decide_access(args.host, os.environ.get(TOKEN_ENV), args.unsafe_no_token)
        if access.warning:
            print(f"trellis-sandbox: {access.warning}", file=sys.stderr, flush=True)
        server = SandboxServer(runner, ServerConfig(args.workers, args.queue_size, args.max_timeout, args.max_request_mb, access.token))
        try:
            asyncio.run(_serve(server, args.host, args.port, access))
        except CannotListen as exc:
            print(f"trellis-sandbox: {exc}", file=sys.stderr)
            return 2
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def watch_children_by_pidfd() -> None:
    """Python 3.11 learns of each run's exit from a thread started per process (``ThreadedChildWatcher``),
    whose start the event loop waits for while every CPU may be busy with runs; a pidfd in the loop's own
    poll needs no thread. 3.12 picks pidfds by itself (and deprecates setting a watcher)."""
    if sys.version_info < (3, 12) and pidfds_work():
        watcher = asyncio.PidfdChildWatcher()
        watcher.attach_loop(asyncio.get_running_loop())
        asyncio.set_child_watcher(watcher)


class CannotListen(Exception):
    """The address is taken or not this machine's."""


async def _serve(server: SandboxServer, host: str, port: int, access: Access) -> None:
    watch_children_by_pidfd()
    app_runner = web.AppRunner(server.app(), access_log=None)
    await app_runner.setup()
    site = web.TCPSite(app_runner, host, port)
    try:
        await site.start()
    except OSError as exc:  # EADDRINUSE, an address of another machine, a host name that does not resolve
        await app_runner.cleanup()
        raise CannotListen(
            f"cannot listen on {host}:{port}: {(exc.strerror or str(exc)).rpartition('): ')[2]}; choose another --port (0 picks a free one) or --host"
        ) from None
    bound = site._server.sockets[0].getsockname()[1]  # the real port when asked for 0
    langs = ", ".join(sorted(server.runner.languages))
    print(
        f"trellis-sandbox: serving http://{host}:{bound} (isolation {server.runner.isolation.kind}, "
        f"{server.config.workers} workers, languages {langs})",
        flush=True,
    )
    if access.token is not None:
        print(f"trellis-sandbox: {client_hint(access)}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await app_runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
