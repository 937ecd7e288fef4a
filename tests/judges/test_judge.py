"""Reward ``judge`` against a real OpenAI-compatible server on loopback, and ``reward.terms`` sums by hand."""

from __future__ import annotations

import json
import socket
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from omegaconf import OmegaConf
from reward_batches import responses

from trellis.config import ConfigError
from trellis.plugins import load_plugins
from trellis.registry import Registry
from trellis.rewards import RewardError
from trellis_algos.rewards import RewardConfig, RewardManager, check_reward, gsm8k_score
from trellis_demo.tasks import task_texts
from trellis_demo.tiny import make_tiny_tokenizer
from trellis_judges.client import JudgeError, judge_score, last_number, preflight, score_tag, yes_no

TEMPLATE = "reference={reference} response={response}"


class JudgeServer:
    """A chat-completions server: replies ``<score>1</score>`` when the prompt's response holds the
    reference, else ``<score>0.25</score>``; ``fail`` is a list of HTTP statuses to answer first."""

    def __init__(self, delay_s: float = 0.0, usage_tokens: int = 10) -> None:
        self.fail: list[int] = []
        self.arrivals: list[float] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.delay_s, self.usage_tokens = delay_s, usage_tokens
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output quiet
                pass

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "judge-model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.arrivals.append(time.monotonic())
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    status = server.fail.pop(0) if server.fail else 200
                time.sleep(server.delay_s)
                with server.lock:
                    server.in_flight -= 1
                if status != 200:
                    return self._send(status, {"error": {"message": f"told to answer {status}"}})
                prompt = body["messages"][0]["content"]
                reference, response = prompt.removeprefix("reference=").split(" response=", 1)
                score = "1" if reference in response else "0.25"
                reply = {"choices": [{"message": {"role": "assistant", "content": f"I think <score>{score}</score>"}}]}
                self._send(200, {**reply, "usage": {"total_tokens": server.usage_tokens}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def requests(self) -> int:
        return len(self.arrivals)


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(task_texts(200, seed=0))


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def judge(server_url, text="#### 46", reference="46", **kwargs):
    return judge_score("arithmetic", text, reference, {}, url=server_url, model="judge-model", template=TEMPLATE, backoff_s=0.01, **kwargs)


def test_parse_rules_by_hand():
    assert last_number("7 of 10, so 0.7") == 0.7 and last_number("score: -2") == -2.0
    assert yes_no("No... on reflection, YES.") == 1.0 and yes_no("yes? no") == 0.0 and yes_no("yesno nope no") == 0.0
    assert score_tag("<score>0.2</score> then <score> 3 </score>") == 3.0
    for rule, text in ((last_number, "none"), (yes_no, "maybe"), (score_tag, "score: 1")):
        with pytest.raises(JudgeError, match=f"parse '{rule.__name__}' found n"):
            rule(text)


def test_retries_on_429_and_5xx_only(server):
    server.fail = [429, 500, 503]
    assert judge(server.url) == 1.0 and server.requests == 4  # three refusals retried, then the answer
    server.fail = [400]
    with pytest.raises(JudgeError, match="refused the request: HTTP 400: .*told to answer 400"):
        judge(server.url)
    assert server.requests == 5  # a 4xx is never retried
    server.fail = [502] * 3
    with pytest.raises(JudgeError, match="answered HTTP 502 after 3 attempts"):
        judge(server.url, retries=2)
    assert server.requests == 8


def test_a_reply_no_rule_parses_raises_without_a_retry(server):
    with pytest.raises(JudgeError, match="parse 'yes_no' found neither 'yes' nor 'no'"):
        judge(server.url, parse="yes_no")
    assert server.requests == 1


def test_the_request_rate_holds_under_a_burst(server):
    # 24 requests from 12 threads at once, limited to 1200 a minute: 20 a second, spaced 50 ms apart
    with ThreadPoolExecutor(12) as pool:
        scores = list(pool.map(lambda _: judge(server.url, requests_per_minute=1200), range(24)))
    assert scores == [1.0] * 24
    span = server.arrivals[-1] - server.arrivals[0]
    assert (len(server.arrivals) - 1) / span <= 20 * 1.1, f"{len(server.arrivals) - 1} requests in {span:.3f} s"


def test_the_tokens_per_minute_hold_under_a_burst():
    # the server bills what the client reserves (prompt characters / 4 plus max_tokens): 8 + 492 =
    # 500 tokens a request; 60000 a minute is 1000 a second after the first second's 1000
    server = JudgeServer(usage_tokens=500)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: judge(server.url, tokens_per_minute=60000, requests_per_minute=60000, max_tokens=492), range(6)))
    span = server.arrivals[-1] - server.arrivals[0]
    assert (6 * 500 - 1000) / span <= 1000 * 1.1, f"6 requests of 500 tokens in {span:.3f} s"
    server.httpd.shutdown()


def test_requests_in_flight_are_capped_for_the_whole_process():
    server = JudgeServer(delay_s=0.1)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: judge(server.url, requests_per_minute=60000, max_in_flight=3), range(12)))
    assert server.max_in_flight == 3
    with pytest.raises(JudgeError, match=r"already runs with .*=\(60000, None, 3\), not \(60000, None, 4\): one limit holds per server"):
        judge(server.url, requests_per_minute=60000, max_in_flight=4)
    server.httpd.shutdown()


def test_preflight_refuses_a_dead_endpoint_and_an_unserved_model(server):
    dead = closed_port_url()
    with pytest.raises(JudgeError, match=f"judge at {dead} did not answer GET /v1/models"):
        preflight(url=dead)
    with pytest.raises(JudgeError, match=r"serves \['judge-model'\], not model='other'"):
        preflight(url=server.url + "/v1", model="other")
    with pytest.raises(JudgeError, match="parse='score'; use one of last_number, yes_no, score_tag"):
        preflight(url=server.url, parse="score")
    with pytest.raises(JudgeError, match=r"judge template uses \['answer'\]"):
        preflight(url=server.url, template="{answer}")
    preflight(url=server.url + "/v1/chat/completions", model="judge-model")
    node = OmegaConf.merge(OmegaConf.structured(RewardConfig), {"name": "judge", "kwargs": {"url": dead}})
    with pytest.raises(ConfigError, match=f"config key 'reward': reward 'judge' is not ready: judge at {dead} did not answer"):
        check_reward(node, load_plugins().registry)


def test_a_dead_endpoint_stops_the_scoring_above_max_error_rate(tok):
    cfg = RewardConfig(name="judge", kwargs={"url": closed_port_url(), "template": TEMPLATE})
    with pytest.raises(RewardError, match=r"reward 'judge' failed on 2 of 2 samples \(100%\), above reward.max_error_rate=0.1"):
        RewardManager(cfg, load_plugins().registry, tok).score(responses(tok, ["#### 46", "#### 4"]))


def test_the_judges_score_reaches_reward_mean(server, tok):
    cfg = RewardConfig(name="judge", kwargs={"url": server.url, "model": "judge-model", "template": TEMPLATE})
    result = RewardManager(cfg, load_plugins().registry, tok).score(responses(tok, ["#### 46", "#### 4", "#### 46"]))
    assert result.scores.tolist() == [1.0, 0.25, 1.0]
    assert result.metrics["reward/mean"] == pytest.approx(0.75) and result.metrics["reward/errors"] == 0.0


# -- reward.terms ------------------------------------------------------------------------------------
def _penalty(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 2.0, "seen": 1.0}


def terms_registry() -> Registry:
    reg = Registry()
    reg.add("reward", "gsm8k", gsm8k_score)
    reg.add("reward", "judge", judge_score)
    reg.add("reward", "penalty", _penalty)
    return reg


def test_terms_sum_their_weighted_scores_by_hand(server, tok):
    judge_kwargs = {"url": server.url, "model": "judge-model", "template": TEMPLATE}
    terms = [{"name": "gsm8k"}, {"name": "judge", "weight": 0.5, "kwargs": judge_kwargs}, {"name": "penalty", "weight": -0.1}]
    result = RewardManager(RewardConfig(terms=terms), terms_registry(), tok).score(responses(tok, ["#### 46", "#### 4"]))
    # gsm8k 1, 0; judge 1, 0.25; penalty 2, 2: 1 + 0.5 - 0.2 = 1.3 and 0 + 0.125 - 0.2 = -0.075
    assert result.scores.tolist() == pytest.approx([1.3, -0.075])
    assert result.token_scores.sum(-1).tolist() == pytest.approx([1.3, -0.075])
    m = result.metrics
    assert m["reward/mean"] == pytest.approx(0.6125) and m["reward/gsm8k"] == 0.5 and m["reward/judge"] == 0.625
    assert m["reward/penalty"] == 2.0 and m["reward/penalty/seen"] == 1.0
    assert {k: v.tolist() for k, v in result.components.items()} == {
        "gsm8k": [1.0, 0.0],
        "judge": [1.0, 0.25],
        "penalty": [2.0, 2.0],
        "penalty/seen": [1.0, 1.0],
    }


def test_a_sample_failing_in_one_term_scores_zero_and_counts_once(tok):
    dead = {"url": closed_port_url(), "template": TEMPLATE}
    cfg = RewardConfig(terms=[{"name": "gsm8k"}, {"name": "judge", "kwargs": dead}], max_error_rate=1.0)
    result = RewardManager(cfg, terms_registry(), tok).score(responses(tok, ["#### 46", "#### 4"]))
    assert result.scores.tolist() == [0.0, 0.0] and result.metrics["reward/errors"] == 2.0
    assert result.components["gsm8k"].tolist() == [1.0, 0.0]  # the term that worked still reports


def test_terms_from_a_users_file_and_keys_of_their_own(tmp_path, tok):
    (tmp_path / "r.py").write_text(
        textwrap.dedent("""
        def length(data_source, solution_str, ground_truth, extra_info=None, per_char=1.0):
            return per_char * len(solution_str)
    """)
    )
    terms = [{"name": "length", "path": str(tmp_path / "r.py"), "kwargs": {"per_char": -0.5}, "key": "short"}, {"name": "gsm8k", "weight": 2}]
    result = RewardManager(RewardConfig(terms=terms), terms_registry(), tok).score(responses(tok, ["#### 46"]))
    length = len(tok.decode(tok("#### 46", add_special_tokens=False)["input_ids"], skip_special_tokens=True))
    assert result.metrics["reward/short"] == -0.5 * length and result.scores.tolist() == [2.0 - 0.5 * length]


@pytest.mark.parametrize(
    ("reward", "error"),
    [
        ({"terms": [{"name": "gsm8k"}, {"name": "gsm8kk"}]}, r"config key 'reward.terms\[1\].name': reward 'gsm8kk' is not installed .* did you"),
        ({"terms": [{"name": "gsm8k"}, {"name": "gsm8k", "weight": 2}]}, r"reward.terms\[1\] and reward.terms\[0\] both log as reward/gsm8k"),
        ({"terms": [{"name": "gsm8k", "key": "mean"}]}, r"reward.terms\[0\] has key 'mean'"),
        ({"terms": [{"name": ""}]}, r"reward.terms\[0\].name is empty"),
        ({"name": "math", "terms": [{"name": "gsm8k"}]}, "reward.terms is set together with reward.name='math'"),
    ],
)
def test_term_config_errors_name_the_key(reward, error):
    node = OmegaConf.merge(OmegaConf.structured(RewardConfig), reward)
    with pytest.raises(ConfigError, match=error):
        check_reward(node, load_plugins().registry)
