"""Who may run code: the server's bearer token, decided from the address it listens on.

A server on this machine's loopback needs no token unless ``TRELLIS_SANDBOX_TOKEN`` gives one
(Sandbox Fusion's API has no authentication and its clients send none). A server on any other
address always needs one: ``TRELLIS_SANDBOX_TOKEN``, else a fresh random token printed at start,
unless ``--unsafe-no-token``. Clients send ``Authorization: Bearer <token>``; the trellis client
reads the token from the same variable, so it never lands in a run's saved config.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import socket
from dataclasses import dataclass

TOKEN_ENV = "TRELLIS_SANDBOX_TOKEN"
NETWORK_WARNING = (
    "WARNING: serving code execution to the network on {host}: anyone who can reach this port and has the token can run code here; "
    "prefer --host 127.0.0.1, or keep a firewall in front of this port"
)
OPEN_PATHS = ("/v1/ping",)  # health checks: they run nothing and say nothing about the server


@dataclass(frozen=True)
class Access:
    """token: what requests must carry (None: anyone who reaches the port may run code).
    generated: the token was made here (print it; the user has no copy). warning: a line for stderr, or ''."""

    token: str | None
    generated: bool = False
    warning: str = ""


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is this machine's loopback (``0.0.0.0``, ``::`` and ``''`` are every interface)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)} if host else set()
    except (socket.gaierror, UnicodeError):
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addresses)


def decide_access(host: str, env_token: str | None, unsafe_no_token: bool) -> Access:
    """The token the server at ``host`` requires, from ``TRELLIS_SANDBOX_TOKEN`` (``env_token``) and the flag."""
    local = is_loopback(host)
    if unsafe_no_token:
        return Access(None, warning="" if local else f"WARNING: --unsafe-no-token on {host}: anyone who can reach this port can run code here")
    warning = "" if local else NETWORK_WARNING.format(host=host)
    if env_token:
        return Access(env_token, False, warning)
    if local:
        return Access(None)
    return Access(secrets.token_urlsafe(32), True, warning)


def client_hint(access: Access) -> str:
    """The line that tells the user how clients pass the token."""
    if access.generated:
        return f"clients must send 'Authorization: Bearer {access.token}'; for trellis runs: export {TOKEN_ENV}={access.token}"
    return f"clients must send 'Authorization: Bearer <the value of {TOKEN_ENV}>'; trellis runs read it from {TOKEN_ENV}"


def refusal(authorization: str | None, token: str) -> str | None:
    """Why a request with this ``Authorization`` header is refused (one line), or None when it carries ``token``."""
    if authorization is None:
        return f"this server needs a token: send 'Authorization: Bearer <token>' (trellis: set {TOKEN_ENV} to the server's token)"
    if not hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode()):
        return f"the token sent is not this server's: give the token `trellis-sandbox serve` printed (or its {TOKEN_ENV})"
    return None
