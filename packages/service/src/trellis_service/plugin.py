"""The ``trellis serve`` command, added to the ``trellis`` command by entry point: the Tinker training
API over trellis's backends and engines, for the tinker SDK and tinker-cookbook."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
from pathlib import Path

import trellis

TOKEN_ENV = "TRELLIS_SERVE_TOKEN"
log = logging.getLogger("trellis")


@trellis.hookimpl
def trellis_add_commands(commands):
    p = commands.add("serve", serve, help="serve the Tinker training API (tinker SDK, tinker-cookbook) over trellis's backends and engines")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=FOLDER",
        help="a base model clients may name, and its Hugging Face folder (repeat for more)",
    )
    p.add_argument("--port", type=int, default=8000, help="the port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default loopback only)")
    p.add_argument("--root", default="trellis-serve", help="the folder checkpoints (tinker:// paths) are written under (default ./trellis-serve)")
    p.add_argument("--backend", default="fsdp", help="the registered backend that trains (default fsdp)")
    p.add_argument("--engine", default="hf", help="the registered rollout engine that samples (default hf)")
    p.add_argument("--max-queue", type=int, default=256, help="requests the server holds before refusing more (HTTP 429; the SDK retries)")


def parse_models(items: list[str]) -> dict[str, Path]:
    """``NAME=FOLDER`` items as a mapping, each folder checked to hold a model config."""
    if not items:
        raise SystemExit("trellis serve: name at least one model: --model NAME=FOLDER (e.g. --model Qwen/Qwen3-8B=/models/qwen3-8b)")
    models = {}
    for item in items:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            raise SystemExit(f"trellis serve: --model {item!r} must be NAME=FOLDER")
        if not (Path(folder) / "config.json").is_file():
            raise SystemExit(f"trellis serve: --model {item!r}: {folder} is not a Hugging Face model folder (no config.json)")
        if name in models:
            raise SystemExit(f"trellis serve: --model names {name!r} twice")
        models[name] = Path(folder).resolve()
    return models


def server_token() -> str:
    """The token clients give as their Tinker API key: ``$TRELLIS_SERVE_TOKEN``, else a new one (printed)."""
    token = os.environ.get(TOKEN_ENV)
    if token is None:
        token = "tml-" + secrets.token_urlsafe(24)
        print(f"trellis serve: no {TOKEN_ENV} set; clients authenticate with TINKER_API_KEY={token}", flush=True)
    elif not token.startswith("tml-"):
        raise SystemExit(f"trellis serve: {TOKEN_ENV} must start with 'tml-' (the tinker SDK refuses other API keys)")
    return token


def serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from trellis_service.server import make_app
    from trellis_service.service import ServeConfig, Service

    config = ServeConfig(parse_models(args.model), Path(args.root).resolve(), args.backend, args.engine, args.max_queue)
    registry = args.plugins.registry
    registry.get("backend", config.backend)  # an unknown name stops here, naming the installed ones
    registry.get("rollout", config.engine)
    if "policy_loss" not in registry.kinds() or not registry.names("policy_loss"):
        raise SystemExit("trellis serve: no losses are installed; pip install trellis-algos")
    token = server_token()
    config.root.mkdir(parents=True, exist_ok=True)
    service = Service(config, registry)
    print(
        f"trellis serve: http://{args.host}:{args.port} (TINKER_BASE_URL), models {', '.join(config.models)}, checkpoints under {config.root}",
        flush=True,
    )
    web.run_app(make_app(service, token), host=args.host, port=args.port, print=None, access_log=None)
    return 0
