"""Rewards: verl's GSM8K rule by hand, math-verify, and the manager (placement, errors, fail_fast, user files)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import sys
import textwrap
import threading

import pytest
import torch
from omegaconf import OmegaConf
from reward_batches import responses

from trellis.plugins import load_plugins
from trellis.registry import Registry
from trellis.rewards import RewardError, load_function
from trellis_algos.rewards import RewardConfig, RewardManager, extract_gsm8k_answer, gsm8k_score, math_score, unknown_sources
from trellis_demo.tasks import task_texts
from trellis_demo.tiny import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(task_texts(200, seed=0))


@pytest.fixture
def registry():
    return load_plugins().registry


# -- gsm8k rule --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("12+34 is #### 46", "46", "46"),
        ("#### 12 first, then #### 46", "46", "46"),  # the last match
        ("#### 4,600", "4600", "4,600"),  # strict strips commas, flexible keeps them (as verl)
        ("#### -5", "-5", "-5"),
        ("####46", None, "46"),  # strict needs the space
        ("#### $46", None, "46"),  # '$' is not in the number class, so strict finds nothing
        ("so 12 then 46.", None, "46."),  # flexible keeps a trailing '.'
        ("no digits here", None, None),
        ("just a dot .", None, "."),  # verl's loop falls through to the lone '.'
    ],
)
def test_extract_by_hand(text, strict, flexible):
    assert extract_gsm8k_answer(text, "strict") == strict
    assert extract_gsm8k_answer(text, "flexible") == flexible


def test_the_300_character_window():
    assert len("#### 46" + "x" * 293) == 300
    assert extract_gsm8k_answer("#### 46" + "x" * 293) == "46"
    assert extract_gsm8k_answer("#### 46" + "x" * 294) is None  # the first '#' falls outside the window
    assert extract_gsm8k_answer("7 " + "x" * 300, "flexible") is None


def test_gsm8k_scores():
    assert gsm8k_score("gsm8k", "#### 46", "46") == 1.0
    assert gsm8k_score("gsm8k", "#### 47", "46") == 0.0
    assert gsm8k_score("gsm8k", "#### 47", "46", format_score=0.1) == 0.1
    assert gsm8k_score("gsm8k", "46", "46", format_score=0.1) == 0.0  # nothing extracted
    assert gsm8k_score("gsm8k", "#### 1,000", "1000", score=2.0) == 2.0
    assert gsm8k_score("gsm8k", "#### 3.50", "3.5") == 0.0  # string comparison, as verl
    assert gsm8k_score("gsm8k", "#### 46", 46) == 1.0  # an integer ground truth still matches
    assert gsm8k_score("gsm8k", "it is 46", "46", method="flexible") == 1.0


def test_core_registers_gsm8k_and_math(registry):
    assert {"gsm8k", "math"} <= set(registry.names("reward"))
    assert registry.get("reward", "gsm8k").plugin == registry.get("reward", "math").plugin


def test_math_reward():
    if importlib.util.find_spec("math_verify") is None:
        pytest.skip("math-verify is not installed (pip install trellis-algos[math])")
    assert math_score("math", "so the answer is $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert math_score("math", "\\boxed{46}", "46") == 1.0
    assert math_score("math", "\\boxed{45}", "46") == 0.0
    assert math_score("math", "no answer", "46") == 0.0


def test_math_reward_without_the_extra_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(RewardError, match=r"pip install trellis-algos\[math\]"):
        math_score("math", "\\boxed{1}", "1")


def test_reward_config_is_an_omegaconf_schema():
    cfg = OmegaConf.merge(OmegaConf.structured(RewardConfig), {"path": "r.py", "name": "f", "kwargs": {"method": "flexible"}})
    assert (cfg.path, cfg.name, cfg.kwargs.method, cfg.fail_fast) == ("r.py", "f", "flexible", False)


# -- manager ---------------------------------------------------------------------------------------
def test_manager_places_the_score_on_the_last_valid_token(tok, registry):
    batch = responses(tok, ["#### 46<|im_end|>", "#### 4", "#### 46", ""])  # 5, 3, 4 and 0 tokens
    manager = RewardManager(RewardConfig(), registry, tok)
    token_scores, metrics = manager(batch)
    expected = torch.zeros(4, 10)
    expected[0, 4] = 1.0  # on <|im_end|>, the last valid token
    expected[2, 3] = 1.0
    assert torch.equal(token_scores, expected)
    result = manager.score(batch)
    assert result.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert metrics == {"reward/mean": 0.5, "reward/max": 1.0, "reward/min": 0.0, "reward/errors": 0.0, "reward/error_rate": 0.0}


def test_manager_passes_kwargs_and_multi_turn_text(tok):
    seen = []

    def spy(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return 1.0 + bonus

    reg = Registry()
    reg.add("reward", "spy", spy)
    # model turn (5 tokens), environment turn "\n<|im_start|>user\n" (4, mask 0), model turn "ok<|im_end|>" (3), padding (2)
    batch = responses(tok, ["#### 46<|im_end|>\n<|im_start|>user\nok<|im_end|>"], width=14)
    batch["response_mask"][0, 5:9] = 0
    token_scores, _ = RewardManager(RewardConfig(name="spy", kwargs={"bonus": 0.5}), reg, tok)(batch)
    assert seen == [("arithmetic", "#### 46\nuser\nok", "46", {"i": 0})]  # environment text included, specials skipped
    assert token_scores[0].nonzero().flatten().tolist() == [11] and token_scores[0, 11] == 1.5
    params = r"parameters are \(data_source, solution_str, ground_truth, extra_info, bonus\)"
    with pytest.raises(RewardError, match=r"reward.kwargs=\{'typo': 1\}.*" + params):
        RewardManager(RewardConfig(name="spy", kwargs={"typo": 1}), reg, tok)


def _flaky(data_source, solution_str, ground_truth, extra_info=None):
    if "4" in solution_str and "46" not in solution_str:
        raise ZeroDivisionError("boom")
    return {"score": 1.0, "acc": 1.0, "note": "text is not a metric"} if "46" in solution_str else 0.0


def test_an_error_scores_zero_counts_and_logs_once(tok, caplog):
    reg = Registry()
    reg.add("reward", "flaky", _flaky)
    manager = RewardManager(RewardConfig(name="flaky", max_error_rate=1.0), reg, tok)
    batch = responses(tok, ["#### 46", "#### 4", "#### 4", "nothing"])
    with caplog.at_level(logging.ERROR, logger="trellis"):
        token_scores, metrics = manager(batch)
        _, again = manager(batch)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "sample 1 (data_source='arithmetic')" in errors[0].getMessage()
    assert "ZeroDivisionError: boom" in errors[0].getMessage()  # the traceback
    assert metrics["reward/errors"] == again["reward/errors"] == 2.0
    assert token_scores.sum(-1).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert metrics["reward/acc"] == 1.0 and "reward/note" not in metrics  # only numeric dict keys
    # per sample: 1 where the dict came back, 0 for the failures and the plain-number score
    components = manager.score(batch).components
    assert list(components) == ["acc"] and components["acc"].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_an_async_reward_is_awaited_every_sample_at_once(tok):
    """verl's GenRM pattern: ``async def compute_score`` awaited (not a coroutine taken for a
    score), a batch's samples all in flight together (each waits until all have started, which
    one-at-a-time would never reach), a raise counted as an error; ``max_concurrency`` bounds it."""
    started, flight = [], {"now": 0, "most": 0}

    async def judge(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        started.append(extra_info["i"])
        flight["now"] += 1
        flight["most"] = max(flight["most"], flight["now"])
        for _ in range(100):  # until every sample has started (or a bounded wait, when they are gated)
            if len(started) == 4:
                break
            await asyncio.sleep(0.001)
        flight["now"] -= 1
        if solution_str == "#### 4":
            raise ValueError("the judge said no")
        return {"score": float(solution_str == "#### 46") + bonus, "acc": 1.0}

    reg = Registry()
    reg.add("reward", "judge", judge)
    batch = responses(tok, ["#### 46", "#### 4", "#### 46", "nothing"])
    result = RewardManager(RewardConfig(name="judge", kwargs={"bonus": 0.5}, max_error_rate=1.0), reg, tok).score(batch)
    assert result.scores.tolist() == [1.5, 0.0, 1.5, 0.5] and result.metrics["reward/errors"] == 1.0
    assert flight["most"] == 4  # every sample awaited at once
    started.clear()
    flight["most"] = 0
    RewardManager(RewardConfig(name="judge", max_concurrency=2, max_error_rate=1.0), reg, tok).score(batch)
    assert flight["most"] == 2


def test_error_rate_and_the_limit_that_stops_the_run(tok):
    reg = Registry()
    reg.add("reward", "flaky", _flaky)
    batch = responses(tok, ["#### 46", "#### 4", "#### 4", "nothing"])  # 2 of 4 raise
    _, metrics = RewardManager(RewardConfig(name="flaky", max_error_rate=0.5), reg, tok)(batch)  # 0.5 is not above 0.5
    assert metrics["reward/error_rate"] == 0.5
    with pytest.raises(RewardError, match=r"reward 'flaky' failed on 2 of 4 samples \(50%\), above reward.max_error_rate=0.25"):
        RewardManager(RewardConfig(name="flaky", max_error_rate=0.25), reg, tok)(batch)


def test_auto_picks_the_reward_by_data_source(tok, registry):
    batch = responses(tok, ["#### 46", "46", "#### 46"])
    batch["data_source"] = ["openai/gsm8k", "openai/gsm8k", "arithmetic"]
    manager = RewardManager(RewardConfig(name="auto", fail_fast=True), registry, tok)
    with pytest.raises(RewardError, match=r"reward 'auto' has no reward for data_source 'arithmetic'; known: openai/gsm8k"):
        manager(batch)
    assert manager.score(batch[:2]).scores.tolist() == [1.0, 0.0]  # gsm8k's strict rule: "#### 46" only
    assert unknown_sources(["openai/gsm8k", "lighteval/MATH", "mine", None]) == ["None", "mine"]


def test_fail_fast_names_the_sample(tok):
    reg = Registry()
    reg.add("reward", "flaky", _flaky)
    manager = RewardManager(RewardConfig(name="flaky", fail_fast=True), reg, tok)
    with pytest.raises(RewardError, match=r"failed on sample 1 \(data_source='arithmetic'\): ZeroDivisionError: boom") as err:
        manager(responses(tok, ["#### 46", "#### 4"]))
    assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_bad_results_count_as_errors(tok):
    reg = Registry()
    reg.add("reward", "no_score", lambda data_source, solution_str, ground_truth, extra_info=None: {"acc": 1.0})
    reg.add("reward", "text", lambda data_source, solution_str, ground_truth, extra_info=None: "yes")
    for name in ("no_score", "text"):
        _, metrics = RewardManager(RewardConfig(name=name, max_error_rate=1.0), reg, tok)(responses(tok, ["#### 46"]))
        assert metrics["reward/errors"] == 1.0
    with pytest.raises(RewardError, match="dict without 'score'"):
        RewardManager(RewardConfig(name="no_score", fail_fast=True), reg, tok)(responses(tok, ["#### 46"]))


def test_user_function_by_path(tok, tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        textwrap.dedent("""
        def helper():
            pass

        def exact(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
            ok = solution_str.strip() == "#### " + ground_truth
            return {"score": scale * ok, "exact": float(ok)}
    """)
    )
    cfg = RewardConfig(name="exact", path=str(path), kwargs={"scale": 2.0})
    token_scores, metrics = RewardManager(cfg, Registry(), tok)(responses(tok, ["#### 46", "#### 45"]))
    assert token_scores.sum(-1).tolist() == [2.0, 0.0] and metrics["reward/exact"] == 0.5

    with pytest.raises(RewardError, match=r"reward.path '.*missing.py' does not exist"):
        RewardManager(RewardConfig(name="exact", path=str(tmp_path / "missing.py")), Registry(), tok)
    with pytest.raises(RewardError, match=r"reward.name 'compute_score' is not defined there in '.*my_reward.py'; functions found: exact, helper"):
        RewardManager(RewardConfig(name="compute_score", path=str(path)), Registry(), tok)


def test_a_reward_file_runs_once_per_process_and_again_when_it_changes(tok, tmp_path):
    """The config check, the reward manager and a judge engine each load reward.path: its top level
    (here, a line appended to a file) runs once, and again only after the file changed."""
    runs = tmp_path / "runs.txt"
    path = tmp_path / "counted.py"
    body = "open({runs!r}, 'a').write('x')\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n    return {value}\n"
    path.write_text(body.format(runs=str(runs), value=1.0))
    first = load_function(path, "score")
    token_scores, _ = RewardManager(RewardConfig(name="score", path=str(path)), Registry(), tok)(responses(tok, ["#### 46"]))
    assert load_function(str(tmp_path / "." / "counted.py"), "score") is first and runs.read_text() == "x"
    assert token_scores.sum().item() == 1.0
    path.write_text(body.format(runs=str(runs), value=2.0))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # a changed file, even within the clock's resolution
    assert load_function(path, "score")("s", "", "") == 2.0 and runs.read_text() == "xx"


def test_unknown_registered_reward_lists_the_installed(tok, registry):
    with pytest.raises(Exception, match="reward 'gsm8kk' is not installed.*did you mean 'gsm8k'"):
        RewardManager(RewardConfig(name="gsm8kk"), registry, tok)


def test_batched_reward(tok):
    def batch_fn(data_sources, solution_strs, ground_truths, extra_infos):
        return [float(len(s)) for s in solution_strs]

    reg = Registry()
    reg.add("reward", "lengths", batch_fn)
    token_scores, metrics = RewardManager(RewardConfig(name="lengths", batched=True), reg, tok)(responses(tok, ["#### 46", "ab"]))
    assert token_scores.sum(-1).tolist() == [7.0, 2.0] and metrics["reward/max"] == 7.0


# -- concurrency -------------------------------------------------------------------------------------
def _gathered(parties):
    """A reward that returns only once ``parties`` calls are inside it at the same time (a barrier):
    run one at a time, it raises BrokenBarrierError after 10 s instead."""
    barrier = threading.Barrier(parties, timeout=10)
    threads = set()

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        threads.add(threading.get_ident())
        barrier.wait()
        return float(extra_info["i"])

    return reward, threads


def test_max_concurrency_scores_samples_at_once_in_order(tok):
    reward, threads = _gathered(4)
    reg = Registry()
    reg.add("reward", "gathered", reward)
    manager = RewardManager(RewardConfig(name="gathered", max_concurrency=4), reg, tok)
    result = manager.score(responses(tok, ["#### 46"] * 8))
    assert result.scores.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # batch order, not finishing order
    assert len(threads) == 4 and threading.get_ident() not in threads
    assert result.metrics["reward/errors"] == 0.0


def test_max_concurrency_comes_from_the_function_and_defaults_to_serial(tok):
    reward, _ = _gathered(3)
    reward.max_concurrency = 3
    reg = Registry()
    reg.add("reward", "gathered", reward)
    in_main = threading.main_thread
    reg.add("reward", "where", lambda data_source, solution_str, ground_truth, extra_info=None: float(threading.current_thread() is in_main()))
    assert RewardManager(RewardConfig(name="gathered"), reg, tok).score(responses(tok, ["x"] * 6)).scores.tolist() == [0, 1, 2, 3, 4, 5]
    manager = RewardManager(RewardConfig(name="where"), reg, tok)
    assert manager.scorers[0].max_concurrency == 1 and manager.score(responses(tok, ["x"] * 3)).scores.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(RewardError, match=r"reward.max_concurrency=0 for reward 'where'; give a whole number >= 1"):
        RewardManager(RewardConfig(name="where", max_concurrency=0), reg, tok)


def test_concurrent_errors_are_handled_as_serial_ones(tok, caplog):
    reg = Registry()
    reg.add("reward", "flaky", _flaky)
    batch = responses(tok, ["#### 46", "#### 4", "#### 4", "nothing"])
    with caplog.at_level(logging.ERROR, logger="trellis"):
        token_scores, metrics = RewardManager(RewardConfig(name="flaky", max_concurrency=4, max_error_rate=1.0), reg, tok)(batch)
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1  # logged once across threads
    assert metrics["reward/errors"] == 2.0 and token_scores.sum(-1).tolist() == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(RewardError, match=r"failed on sample 1 \(data_source='arithmetic'\): ZeroDivisionError"):
        RewardManager(RewardConfig(name="flaky", max_concurrency=4, fail_fast=True), reg, tok)(batch)
