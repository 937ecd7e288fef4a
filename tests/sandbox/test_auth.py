"""The server's bearer token against the real server on loopback: no token or a wrong one gets 401 with
its reason, the right one runs; the trellis client and the reward send TRELLIS_SANDBOX_TOKEN; a server
on every interface warns and makes a token of its own; loopback without a token stays open (Sandbox
Fusion's clients send none)."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request

import pytest
from sandbox_server import start_server, stop

from trellis_sandbox.api import RunRequest
from trellis_sandbox.auth import NETWORK_WARNING, decide_access, is_loopback
from trellis_sandbox.client import SandboxClient
from trellis_sandbox.reward import compute_score

TOKEN = "s3cret-token-of-the-test"
PRINT = {"code": "print(6 * 7)", "language": "python"}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server on 127.0.0.1 given a token through TRELLIS_SANDBOX_TOKEN."""
    srv = start_server(tmp_path_factory.mktemp("home"), env={"TRELLIS_SANDBOX_TOKEN": TOKEN})
    yield srv
    stop(srv.proc)


def test_requests_without_the_token_get_401_naming_the_fix(guarded):
    assert guarded.token == TOKEN
    status, body = guarded.post(PRINT, headers={})
    assert status == 401 and body["status"] == "SandboxError"
    assert (
        body["message"]
        == "this server needs a token: send 'Authorization: Bearer <token>' (trellis: set TRELLIS_SANDBOX_TOKEN to the server's token)"
    )
    for wrong in ("Bearer nope", f"Bearer {TOKEN}x", TOKEN, f"bearer {TOKEN}"):
        status, body = guarded.post(PRINT, headers={"Authorization": wrong})
        assert status == 401 and body["message"].startswith("the token sent is not this server's"), wrong
    assert guarded.stats()["refused_401"] == 5 and guarded.stats()["runs"] == 0  # nothing ran
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(f"{guarded.url}/stats", timeout=10)
    with urllib.request.urlopen(f"{guarded.url}/v1/ping", timeout=10) as resp:  # health checks stay open
        assert resp.read() == b"pong"


def test_the_right_token_runs_and_the_program_cannot_read_it(guarded):
    status, body = guarded.post({"code": "import os; print(sorted(os.environ)); print(6 * 7)", "language": "python"})
    assert status == 200 and body["run_result"]["stdout"].endswith("42\n")
    assert "TRELLIS_SANDBOX_TOKEN" not in body["run_result"]["stdout"]


def test_the_client_sends_the_token_from_the_environment_and_reports_a_refusal_once(guarded, monkeypatch, caplog):
    monkeypatch.setenv("TRELLIS_SANDBOX_TOKEN", TOKEN)
    client = SandboxClient(guarded.url)
    assert client.run_sync(RunRequest("print(6 * 7)", "python")).run_result.stdout == "42\n"
    client.close()
    wrong = SandboxClient(guarded.url, token="nope", backoff_s=0.01)
    with caplog.at_level(logging.ERROR, logger="trellis.sandbox"):
        responses = [wrong.run_sync(RunRequest("print(1)", "python")) for _ in range(2)]
    wrong.close()
    for resp in responses:
        assert resp.status == "SandboxError" and resp.message.startswith(f"HTTP 401 from {guarded.url}: the token sent is not this server's")
    assert wrong.requests == 2  # a refusal is not retried
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "HTTP 401" in errors[0] and "nope" not in errors[0]


def test_the_reward_scores_through_a_token_server(guarded, monkeypatch):
    monkeypatch.setenv("TRELLIS_SANDBOX_TOKEN", TOKEN)
    cases = '{"inputs": ["2 3\\n"], "outputs": ["5\\n"]}'
    answer = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert compute_score("code", answer, cases, url=guarded.url)["score"] == 1.0


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_needs_no_token_unless_one_is_given(host):
    assert is_loopback(host)
    assert decide_access(host, None, False).token is None
    given = decide_access(host, TOKEN, False)
    assert (given.token, given.generated, given.warning) == (TOKEN, False, "")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.0.2.7", "no-such-host.invalid"])
def test_any_other_host_gets_a_token_and_a_warning(host):
    assert not is_loopback(host)
    made, again = decide_access(host, None, False), decide_access(host, None, False)
    assert made.generated and len(made.token) >= 40 and made.token != again.token
    assert made.warning == NETWORK_WARNING.format(host=host) and f"on {host}: anyone who can reach this port" in made.warning
    given = decide_access(host, TOKEN, False)
    assert (given.token, given.generated, given.warning) == (TOKEN, False, made.warning)
    bare = decide_access(host, TOKEN, True)
    assert bare.token is None and bare.warning.startswith(f"WARNING: --unsafe-no-token on {host}")


def test_serving_on_every_interface_warns_and_requires_the_printed_token(tmp_path):
    proc = start_server(tmp_path / "home", "--host", "0.0.0.0", env={"TRELLIS_SANDBOX_TOKEN": ""}, check=False)
    try:
        serving, hint = proc.stdout.readline(), proc.stdout.readline()
        assert "serving http://0.0.0.0:" in serving, (serving, hint)
        port = int(serving.split("http://0.0.0.0:", 1)[1].split(" ", 1)[0])
        token = hint.split("export TRELLIS_SANDBOX_TOKEN=", 1)[1].strip()
        assert hint == f"trellis-sandbox: clients must send 'Authorization: Bearer {token}'; for trellis runs: export TRELLIS_SANDBOX_TOKEN={token}\n"
        client = SandboxClient(f"http://127.0.0.1:{port}", token=token)
        assert client.run_sync(RunRequest("print(6 * 7)", "python")).run_result.stdout == "42\n"
        client.close()
        bare = SandboxClient(f"http://127.0.0.1:{port}", token="")
        assert bare.run_sync(RunRequest("print(1)", "python")).message.endswith(
            "this server needs a token: send 'Authorization: Bearer <token>' (trellis: set TRELLIS_SANDBOX_TOKEN to the server's token)"
        )
        bare.close()
    finally:
        stop(proc)
    assert "trellis-sandbox: " + NETWORK_WARNING.format(host="0.0.0.0") in proc.stderr.read()
