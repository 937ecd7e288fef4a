"""How one run is isolated: bubblewrap, else ``unshare`` namespaces, else (only when asked) nothing.

Either way the program gets: no network (a new, empty network namespace), its own PID namespace
(every process in it dies when the run's first process ends or is killed), the whole file system
read-only, a fresh empty ``/tmp`` (and server's home, when it is not ``/``) with the run's work dir
bound read-write at ``/tmp/work``, a scrubbed environment, and no capabilities. When the server
runs as root, each worker slot runs its programs as its own unprivileged uid (``uid_base + slot``),
so that the per-user process limit counts that run's processes only.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

WORK_MOUNT = "/tmp/work"
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
SCRUBBED_ENV = {"PATH": SAFE_PATH, "HOME": WORK_MOUNT, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
# bwrap's launchers need only PATH: without LANG, setpriv, prlimit and bwrap each skip loading the
# C.UTF-8 locale's files (about 0.1 ms of CPU apiece a run); the program still gets SCRUBBED_ENV.
LAUNCHER_ENV = {"PATH": SAFE_PATH}


class IsolationUnavailable(RuntimeError):
    """Neither bubblewrap nor unshare namespaces work here; the message says what was tried and the fix."""


@dataclass(frozen=True)
class Isolation:
    """kind: ``bwrap``, ``unshare`` or ``none``; hidden: host folders replaced by an empty tmpfs."""

    kind: str
    hidden: tuple[str, ...] = ()

    def wrap(self, argv: list[str], workdir: Path, stage: Path, rlimits: tuple[str, ...] = ()) -> list[str]:
        """The command that runs ``argv`` inside the sandbox with ``workdir`` at ``WORK_MOUNT``, under the
        ``rlimits`` command prefix (``prlimit ... --``). ``stage``: an empty folder next to ``workdir`` (the
        unshare form writes its mount table there and builds the new /tmp on it). Start it with
        ``env=self.launcher_env()``."""
        if self.kind == "bwrap":
            # bwrap starts under the limits (its two processes count in them) and hands them on to the
            # program: prlimit then runs outside the sandbox, in the launchers' locale-free environment
            return [*rlimits, *self._bwrap(argv, workdir)]
        if self.kind == "unshare":
            return self._unshare([*rlimits, *argv], workdir, stage)
        return ["env", "-i", *(f"{k}={v}" for k, v in {**SCRUBBED_ENV, "HOME": str(workdir)}.items()), *rlimits, *argv]

    def launcher_env(self) -> dict[str, str]:
        """The environment to start :meth:`wrap`'s command in. Scrubbed for every kind, because the launcher's
        own process is visible from inside the sandbox (bwrap's as PID 1); the unshare form's program
        inherits it."""
        return LAUNCHER_ENV if self.kind == "bwrap" else SCRUBBED_ENV

    def workdir_in_sandbox(self, workdir: Path) -> str:
        return str(workdir) if self.kind == "none" else WORK_MOUNT

    def _bwrap(self, argv: list[str], workdir: Path) -> list[str]:
        cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/", "/"]
        # --dev builds a new /dev whose /dev/shm is already a fresh folder the program may write
        cmd += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp"]
        for folder in _outside_tmp(self.hidden):  # the new /tmp hides those inside it (and stays empty)
            cmd += ["--tmpfs", folder]
        cmd += ["--bind", str(workdir), WORK_MOUNT, "--chdir", WORK_MOUNT, "--clearenv"]
        for k, v in SCRUBBED_ENV.items():
            cmd += ["--setenv", k, v]
        return [*cmd, "--cap-drop", "ALL", "--", *argv]

    def _unshare(self, argv: list[str], workdir: Path, stage: Path) -> list[str]:
        # Inside a new user namespace the setup shell is root with capabilities over its own mounts. One
        # `mount -a` reads the run's mount table (written into `stage`, read before anything is mounted
        # over it): a tmpfs on `stage` with the work dir bound into it, that tree bound over /tmp, the home
        # and the other hidden folders under tmpfs, /proc for the new PID namespace; then / turns
        # read-only and `setpriv` drops every capability (so the program cannot undo a mount) and runs
        # the program in the launcher's clean environment (the caller starts this command with
        # env=SCRUBBED_ENV, as it does bwrap). Each exec costs about 1.5 ms in a VM: one table instead of
        # a `mount` per folder halves the set-up. The shell stays as PID 1 (as bwrap does), so the program
        # is an ordinary process: signals reach it, and its exit status (128 + n when killed by signal n)
        # is the shell's.
        q = shlex.quote
        table = stage / "fstab"
        table.write_text(_mount_table(workdir, stage, [d for d in _outside_tmp(("/var/tmp", "/dev/shm", *self.hidden)) if os.path.isdir(d)]))
        ip = shutil.which("ip", path="/usr/sbin:/sbin:/usr/bin:/bin")
        steps = [
            f"mount -n -a -T {q(str(table))}",
            *([f"{q(ip)} link set lo up"] if ip else []),  # as bwrap does: a loopback of its own
            "mount -n -o remount,bind,ro /",
            f"cd {WORK_MOUNT}",
            "unset OLDPWD PWD",  # the shell's own, not the launcher's
            "setpriv --bounding-set=-all --inh-caps=-all --no-new-privs " + " ".join(q(a) for a in argv),
        ]
        unshare = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child"]
        return [*unshare, "--propagation", "private", "sh", "-ec", "; ".join(steps)]


def _mount_table(workdir: Path, stage: Path, hidden: list[str]) -> str:
    """The fstab(5) lines of an unshare run's mounts, in order (``mount -a`` keeps it). The tmpfs and
    proc sources are named ``sandbox`` so that none looks like a mount the host already has (which
    ``mount -a`` would skip); ``rbind`` carries the work dir's bind along with the tmpfs."""
    lines = [
        ("sandbox", stage, "tmpfs", "mode=1777"),
        (workdir, stage / "work", "none", "bind,X-mount.mkdir"),
        (stage, "/tmp", "none", "rbind"),
        *(("sandbox", d, "tmpfs", "defaults") for d in hidden),
        ("sandbox", "/proc", "proc", "defaults"),
    ]
    return "".join(f"{_fstab_field(src)} {_fstab_field(dst)} {kind} {opts} 0 0\n" for src, dst, kind, opts in lines)


def _fstab_field(path: object) -> str:
    """A path as fstab(5) spells it: white space and backslashes as octal escapes."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in str(path))


def _outside_tmp(folders: tuple[str, ...]) -> list[str]:
    """Those of ``folders`` not inside /tmp (which the new, empty /tmp already hides)."""
    return [f for f in folders if f != "/tmp" and not f.startswith("/tmp/")]


def hidden_folders() -> tuple[str, ...]:
    """The server's home, when it is a real folder other than ``/`` (its files stay out of reach)."""
    home = os.path.realpath(os.path.expanduser("~"))
    return (home,) if home not in ("/", "/tmp") and os.path.isdir(home) else ()


def as_user(cmd: list[str], uid: int | None) -> list[str]:
    """``cmd`` run as ``uid`` (its own group, no others) when given. The switch is an exec'd ``setpriv``
    rather than Popen's ``user=``: Python spawns with fork instead of vfork when asked to change ids, and
    copying the server's page tables for every run cost more than the extra exec."""
    if uid is None:
        return cmd
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *cmd]


def _works(cmd: list[str], user: int | None, env: dict[str, str]) -> str | None:
    """None when ``cmd`` runs as ``user`` in ``env`` and prints ``ok``; else why not."""
    try:
        out = subprocess.run(as_user(cmd, user), capture_output=True, text=True, timeout=20, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if out.returncode == 0 and out.stdout.strip().endswith("ok"):
        return None
    return (out.stderr or out.stdout).strip()[-300:] or f"exit code {out.returncode}"


def detect(preferred: str, probe_user: int | None, scratch: Path) -> Isolation:
    """The first isolation of ``preferred`` (``auto``, ``bwrap``, ``unshare``, ``none``) that works on this
    machine, tried for real as ``probe_user``; :class:`IsolationUnavailable` when none does."""
    if preferred == "none":
        return Isolation("none")
    hidden = hidden_folders()
    kinds = ["bwrap", "unshare"] if preferred == "auto" else [preferred]
    problems = []
    for kind in kinds:
        tool = "bwrap" if kind == "bwrap" else "unshare"
        if shutil.which(tool) is None:
            problems.append(f"{kind}: `{tool}` is not installed")
            continue
        work, stage = scratch / f"probe-{kind}", scratch / f"probe-{kind}-stage"
        for d in (work, stage):
            d.mkdir(parents=True, exist_ok=True)
            if probe_user is not None:
                os.chown(d, probe_user, probe_user)
        iso = Isolation(kind, hidden)
        why = _works(iso.wrap(["sh", "-c", "echo ok"], work, stage), probe_user, iso.launcher_env())  # as runs start
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(stage, ignore_errors=True)
        if why is None:
            return iso
        problems.append(f"{kind}: {why}")
    raise IsolationUnavailable(
        "no isolation works on this machine (" + "; ".join(problems) + "). Install bubblewrap (Debian/Ubuntu: "
        "`apt-get install bubblewrap`) or allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), "
        "or start with --unsafe-no-isolation to run programs with rlimits only (never with untrusted code)"
    )
