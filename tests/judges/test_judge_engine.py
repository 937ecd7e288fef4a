"""``reward.judge``: a judge model the rl recipe serves itself (the tiny model on the ``hf`` engine),
called over real HTTP on loopback; its refusals before any model is built."""

from __future__ import annotations

import pytest
from engine_cases import check_judge_engine
from engine_cases import judge_closed as closed

import trellis_judges.engine as engine_module
from trellis.config import ConfigError
from trellis.recipes.train import train
from trellis.rewards import RewardError
from trellis_algos.rewards import RewardConfig
from trellis_judges import client as judge
from trellis_judges.engine import start_judge, with_served_judges
from trellis_judges.server import JudgeServer

TEMPLATE = "Grade this answer to the reference {reference}: {response}"


@pytest.fixture
def served(monkeypatch):
    """The judge servers the rl recipe starts, kept for the test to inspect after the run."""
    started: list[JudgeServer] = []

    def start(*args, **kwargs):
        started.append(start_judge(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(engine_module, "start_judge", start)
    return started


def test_the_server_answers_chat_completions_with_the_run_token_only(tiny_model_path):
    check_judge_engine("hf", tiny_model_path)


def test_a_failed_engine_build_is_raised_by_start():
    def broken():
        raise RuntimeError("no such device")

    server = JudgeServer(broken, None, "m", 8, {})
    with pytest.raises(RuntimeError, match="no such device"):
        server.start()
    server.close()


def test_only_judges_without_a_url_are_sent_to_the_server():
    cfg = RewardConfig(terms=[
        {"name": "judge", "key": "hosted", "kwargs": {"url": "http://judge.example:8000", "template": TEMPLATE}},
        {"name": "judge", "key": "local", "kwargs": {"template": TEMPLATE}},
        {"name": "gsm8k"},
    ], judge={"engine": "hf", "model": "/models/judge"})  # fmt: skip

    class Server:
        url, token, name = "http://127.0.0.1:1234", "secret", "/models/judge"

    pointed = with_served_judges(cfg, Server())
    hosted, local, rule = (t.kwargs for t in pointed.terms)
    assert hosted == {"url": "http://judge.example:8000", "template": TEMPLATE} and rule == {}
    assert local == {"template": TEMPLATE, "url": Server.url, "api_key": "secret", "model": "/models/judge"}
    assert cfg.terms[1].kwargs == {"template": TEMPLATE}  # the config itself is left as it was


def test_an_rl_run_is_scored_by_the_judge_engine_it_serves(run_rl, tiny_model_path, served, monkeypatch):
    # a random tiny model writes no score: a test-only rule turns any reply into a number
    replies: list[float] = []

    def chars(text: str) -> float:
        replies.append(float(len(text) % 5))
        return replies[-1]

    monkeypatch.setitem(judge.PARSERS, "chars", chars)
    summary, rows = run_rl(
        "reward.name=judge",
        f"reward.kwargs={{template: '{TEMPLATE}', parse: chars, max_tokens: 6}}",
        "reward.judge.engine=hf",
        f"reward.judge.model={tiny_model_path}",
        "reward.judge.max_new_tokens=8",
    )
    (server,) = served
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    # 4 prompts x 4 samples a step, each one request the server answered; validation before and
    # after: 8 held-out prompts greedy and 8 sampled
    assert [r["judge/requests"] for r in steps] == [16.0, 16.0] and all(r["judge/refused"] == 0 for r in steps)
    assert all(0 < r["judge/completion_tokens"] <= 16 * 6 for r in steps)
    assert server.counts()["requests"] == len(replies) == 2 * 16 + 2 * 16
    # the step's rewards are the judge's replies read by the rule (validation's 16 came first)
    for i, row in enumerate(steps):
        scores = replies[16 * (i + 1) : 16 * (i + 2)]
        assert row["reward/mean"] == pytest.approx(sum(scores) / 16) and row["reward/max"] == max(scores) and row["reward/errors"] == 0
    assert set(summary["val_after"]) == {"greedy_reward_mean", "reward_mean"}
    assert closed(server.url)  # closed with the run


def test_unparseable_judge_replies_are_errors_that_stop_the_run(run_rl, tiny_model_path, served):
    with pytest.raises(RewardError) as caught:
        run_rl(
            "reward.name=judge",
            f"reward.kwargs={{template: '{TEMPLATE}', max_tokens: 4}}",  # the default rule: a <score> tag
            "reward.judge.engine=hf",
            f"reward.judge.model={tiny_model_path}",
            "validation.before_train=false",
        )
    message = str(caught.value)
    assert "reward 'judge' failed on 16 of 16 samples (100%), above reward.max_error_rate=0.1" in message
    assert "JudgeError: parse 'score_tag' found no <score>number</score> in the judge's reply" in message
    (server,) = served
    assert server.counts()["requests"] == 16 and closed(server.url)  # served every sample, and closed on the error


# a reward function in verl's GenRM shape (verl-recipe's FAPO): a rule-based check, and a served
# model asked through verl's reward router with SGLang's native /generate; written for this test
ROUTED_FUNCTION = """
import json
import urllib.request

def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address, reward_model_tokenizer):
    ids = reward_model_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Check: " + solution_str}], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).encode()
    with urllib.request.urlopen(f"http://{reward_router_address}/generate", body, timeout=60) as resp:
        out = json.loads(resp.read())
    return {"score": float(len(out["output_ids"])), "asked": 1.0}
"""


def test_a_function_of_verls_genrm_shape_asks_the_served_model_through_the_reward_router(run_rl, tiny_model_path, served, tmp_path):
    path = tmp_path / "genrm.py"
    path.write_text(ROUTED_FUNCTION)
    _, rows = run_rl(
        f"reward.path={path}",
        "reward.name=compute_score",
        "reward.judge.engine=hf",
        f"reward.judge.model={tiny_model_path}",
        "reward.judge.max_new_tokens=4",  # the server's cap, below the function's 5
        "validation.before_train=false",
    )
    (server,) = served
    steps = [r for r in rows if "reward/mean" in r]
    # every sample asked the model once; its score is the number of tokens the model wrote for it
    assert [r["judge/requests"] for r in steps] == [16.0, 16.0] and all(r["judge/refused"] == 0 for r in steps)
    assert [r["reward/mean"] * 16 for r in steps] == pytest.approx([r["judge/completion_tokens"] for r in steps])
    assert all(0 < r["reward/mean"] <= 4 and r["reward/errors"] == 0 for r in steps)
    assert closed(server.url)


# -- refusals before any model is built -------------------------------------------------------------------
def refused(*overrides: str, recipe: str = "rl") -> str:
    with pytest.raises(ConfigError) as caught:
        train(None, [f"recipe={recipe}", *overrides], dry_run=True)
    return str(caught.value)


def test_bad_judge_engine_configs_are_refused_by_name(tiny_model_path, data_files, tmp_path):
    base = [f"model.path={tiny_model_path}", f"data.train_path={data_files['train']}"]
    judge_ = ["reward.name=judge", f"reward.kwargs.template='{TEMPLATE}'"]
    engine = ["reward.judge.engine=hf", f"reward.judge.model={tiny_model_path}"]

    message = refused(*base, *judge_, "reward.judge.engine=hff", f"reward.judge.model={tiny_model_path}")
    assert message.startswith("config key 'reward.judge.engine' is 'hff': rollout 'hff' is not installed") and "did you mean 'hf'?" in message
    message = refused(*base, *engine)  # reward.name is gsm8k
    assert "'reward.judge.engine' is 'hf', but no judge reward is in use (reward.name='gsm8k'" in message and "reward.name=judge" in message
    assert "takes reward_router_address" in message
    message = refused(*base, *engine, "reward.terms=[{name: gsm8k}, {name: judge, kwargs: {url: 'http://127.0.0.1:9', template: x}}]")
    assert "every judge names its own server (reward.terms[1].kwargs.url='http://127.0.0.1:9')" in message and "unset reward.judge.engine" in message
    genrm = tmp_path / "genrm.py"
    genrm.write_text(ROUTED_FUNCTION)
    message = refused(*base, f"reward.path={genrm}", "reward.name=compute_score")  # no model served for its router
    assert "missing a required argument: 'reward_router_address'" in message and "serve the model with reward.judge.engine" in message
    message = refused(*base, *judge_, "reward.judge.engine=hf")
    assert "config key 'reward.judge.model' is ''" in message and "no config.json" in message
    message = refused(*base, *judge_, f"reward.judge.model={tiny_model_path}")
    assert "reward.judge.engine is not set" in message
    message = refused(*base, *judge_, *engine, "reward.kwargs.model=gpt-4o")
    assert message.startswith("config key 'reward.kwargs.model' is 'gpt-4o'") and "drop reward.kwargs.model" in message
    message = refused(*base, *judge_, *engine, "reward.judge.options.dtyp=float32")
    assert "unknown config key 'reward.judge.options.dtyp'" in message and "did you mean 'reward.judge.options.dtype'?" in message
    message = refused(*base, *judge_, *engine, "reward.kwargs.parse=score")
    assert "config key 'reward': reward 'judge' is not ready: judge parse='score'" in message
    message = refused(*base, *judge_)  # neither a url nor an engine
    assert "reward.kwargs.url=None" in message and "reward.judge.engine" in message
    message = refused(*base, *judge_, *engine, recipe="spin")
    assert "config key 'reward.judge.engine' is 'hf', but recipe 'spin' serves no judge model" in message
    # the same settings pass the rl recipe's checks
    assert train(None, ["recipe=rl", *base, *judge_, *engine], dry_run=True)["data"].startswith("64 training prompts")
