"""The reward manager that scores a batch of responses, the ``reward`` section of the ``rl`` and
``spin`` recipes, and the rule rewards (``gsm8k``, ``math``, ``auto``) registered under kind ``reward``.

A reward function has verl's signature ``compute_score(data_source, solution_str, ground_truth,
extra_info, **kwargs) -> float | dict`` (a dict holds ``score``; its other numbers become
metrics ``reward/<key>``), or is an ``async def`` of it (awaited, a batch's samples at once).
It is registered under kind ``reward`` by a plugin, or loaded from a user's ``.py`` file
(``reward.path`` + ``reward.name``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import re
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional, Protocol

import torch

from trellis import (
    Batch,
    ConfigError,
    RegistryError,
    RewardError,
    RewardResult,
    Scorer,
    choice,
    instantiate_options,
    last_valid_index,
    load_function,
    ranged,
    switch,
)
from trellis.kit.recipe import reward_figures

logger = logging.getLogger("trellis")


# -- gsm8k: verl's rule ------------------------------------------------------------------------------
_SOLUTION_CLIP_CHARS = 300


_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer verl's GSM8K rule reads from ``solution_str``, or None.

    Only the last 300 characters are searched. ``strict``: the last ``#### <number>`` match, with
    commas and ``$`` removed. ``flexible``: the last run of digits / ``.`` / ``,`` (optionally led
    by ``-``) that is not a lone ``.``, kept as written (commas are *not* removed, as in verl).
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method={method!r}; use 'strict' or 'flexible'")
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(solution_str)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _FLEXIBLE.findall(solution_str)
    answer = None
    for answer in reversed(found):
        if answer not in ("", "."):
            break
    return answer


def gsm8k_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's GSM8K rule (``verl/utils/reward_score/gsm8k.py``, ``compute_score``): ``score`` when the
    extracted answer equals the ground truth, ``format_score`` when an answer was extracted but is
    wrong, 0 when none was. See :func:`extract_gsm8k_answer` for ``method``.

    One deliberate difference: the ground truth is compared as ``str(ground_truth)``, so an integer
    ground truth from a parquet file matches ``"46"`` (verl compares the raw value and would score 0).
    """
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth) else float(format_score)


# -- math: math-verify ---------------------------------------------------------------------------------
def math_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    timeout_seconds: int = 5,
) -> float:
    """1.0 when ``math-verify`` finds the answer in ``solution_str`` (a LaTeX or plain expression,
    ``\\boxed{}`` preferred) equal to ``ground_truth`` (read as ``\\boxed{ground_truth}``, as verl's
    math_verify reward does), else 0.0. Needs the extra: ``pip install trellis-algos[math]``.

    math-verify's timeouts use ``signal.alarm``, which only works in the main thread; elsewhere they
    are switched off.
    """
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError:
        raise RewardError("reward 'math' needs math-verify: pip install trellis-algos[math]") from None
    t = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{ground_truth}}}", extraction_config=[LatexExtractionConfig()], parsing_timeout=t)
    pred = parse(solution_str, extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()], parsing_timeout=t)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=t) else 0.0


# -- auto: by data source, as verl's default scoring -----------------------------------------------
AUTO_SOURCES = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
}


def unknown_sources(data_sources: Any) -> list[str]:
    """The data sources among ``data_sources`` that ``reward.name: auto`` has no reward for."""
    return sorted({str(s) for s in data_sources if s not in AUTO_SOURCES})


def auto_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any) -> float:
    """The reward for the sample's ``data_source`` (``AUTO_SOURCES``: gsm8k's rule, math-verify)."""
    rule = AUTO_SOURCES.get(data_source)
    if rule is None:
        raise RewardError(f"reward 'auto' has no reward for data_source {data_source!r}; known: {', '.join(AUTO_SOURCES)}")
    return (gsm8k_score if rule == "gsm8k" else math_score)(data_source, solution_str, ground_truth, extra_info, **kwargs)


# -- config and resolution -------------------------------------------------------------------------
@dataclass
class OverlongConfig:
    """DAPO's soft overlong punishment (:func:`overlong_penalty`) on training samples: responses in
    the last ``buffer_len`` tokens before ``sampling.max_new_tokens`` lose up to ``penalty``
    (0: off)."""

    buffer_len: int = switch(ranged(0, ge=0), off=0, turn_on="to the buffer's length in tokens (e.g. 4) to penalize long responses")
    penalty: float = ranged(1.0, ge=0)


@dataclass
class RewardTerm:
    """One term of ``reward.terms``: a reward (``name``, ``path``, ``kwargs``, ``batched`` as in
    :class:`RewardConfig`) whose score, times ``weight``, is added to the sample's score. Its
    unweighted score is the metric and component ``key`` (default ``name``): ``reward/<key>``."""

    name: str = ""
    weight: float = ranged(1.0, ge=-1e6, le=1e6)  # any sign (a negative weight is a penalty), finite
    kwargs: dict[str, Any] = field(default_factory=dict)
    path: Optional[str] = None  # noqa: UP045
    batched: bool = False
    key: Optional[str] = None  # noqa: UP045


@dataclass
class RewardModelConfig:
    """A reward model scoring every sample (the ``rl`` recipe's ``reward_model`` role, which
    trellis-judges' reward service ``reward_model`` spawns): ``path``,
    a sequence-classification folder with one label (the ``rm`` recipe's ``hf_model``) and the
    actor's tokenizer (empty: none). Its score at each sample's last token, times ``weight``, is
    the sample's reward, added to the sum of ``reward.terms`` when they are given; its unweighted
    score is the metric and component ``key``: ``reward/<key>``.

    layout: what the reward model reads. ``sampled``: the sample as the ``rm`` recipe trains on it
    (the policy's token ids when the tokenizers and chat templates match, else the prompt rendered
    with the generation prompt, the response's text and eos), scored at its last token.
    ``conversation``: the prompt's messages and the response's text as an assistant message,
    rendered with the reward model's chat template without a generation prompt and scored at its
    last token, as verl's reward loop (and TRL's reward trainer) lay it out."""

    path: str = ""
    weight: float = ranged(1.0, ge=-1e6, le=1e6)
    key: str = "reward_model"
    layout: str = choice("sampled", ("sampled", "conversation"))


@dataclass
class JudgeEngineConfig:
    """A judge model the ``rl`` recipe serves itself (``reward.judge``; reward service ``judge_engine``
    of trellis-judges).

    engine: a registered rollout engine (``hf``, ``vllm``, ``sglang``...; null: none), built from the
        folder ``model`` with the engine's ``options`` (the keys that engine takes under ``rollout``),
        frozen (it never takes a weight sync), and served for the run on loopback as OpenAI-compatible
        chat completions. Every ``judge`` reward or term that names no ``kwargs.url`` is sent to it;
        one that names a url keeps it.
    max_new_tokens: the longest reply (a request's ``max_tokens`` may ask for fewer).
    chat_template_kwargs: passed to the judge tokenizer's chat template (e.g. ``{enable_thinking: false}``).
    """

    engine: Optional[str] = choice(None, kind="rollout")  # noqa: UP045
    model: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int = ranged(512, ge=1)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def given(self) -> bool:
        """Whether the section is set at all (an engine, a model or options): a reward service must serve it."""
        return bool(self.engine or self.model or self.options)


DEFAULT_REWARD = "gsm8k"  # reward.name left unset, where no model or terms give the reward


@dataclass
class RewardConfig:
    """Which reward to use.

    name: a registered reward (``gsm8k``, ``math``, ``auto``: by each sample's ``data_source``, or a
        plugin's), or with ``path`` the function's name in that file. Unset (null): ``gsm8k``, unless
        ``model`` or ``terms`` give the reward, where a name set too is refused (it would be ignored).
    path: a user's ``.py`` file holding the function; None = use the registry.
    fail_fast: a reward that raises stops the run (instead of scoring the sample 0).
    batched: the function scores a whole batch: ``f(data_sources, solution_strs, ground_truths,
        extra_infos, **kwargs) -> list`` (verl's batch reward manager); also set by a ``batched = True``
        attribute on the function.
    kwargs: extra keyword arguments for every call (verl's ``reward_kwargs``), e.g. ``{method: flexible}``.
    max_concurrency: how many samples of a batch are scored at once, each call in a thread of a pool
        (for rewards that wait on something, such as a code sandbox); None = the function's
        ``max_concurrency`` attribute, else 1 (one after another). Ignored when batched. An
        ``async def`` function is awaited on one event loop, at most this many at once (None:
        the attribute, else every sample of the batch at once, as verl's reward loop awaits them).
    max_error_rate: the run stops when a larger share of a batch's samples fail to score (1: never).
        A sample that could not be scored is never a silent 0 (a reward that cannot reach its
        server raises), so the default stops a run whose reward mostly does not work.
    overlong: length shaping added to training samples' scores (not to validation's); see
        :class:`OverlongConfig`.
    terms: several rewards summed, each with its weight (:class:`RewardTerm`); when given, ``name``,
        ``path``, ``kwargs`` and ``batched`` are not used (leave them unset). ``fail_fast``,
        ``max_concurrency`` and ``max_error_rate`` hold for every term; a sample that fails in any
        term scores 0 and counts once in ``reward/errors``.
    model: a reward model (:class:`RewardModelConfig`, the ``rl`` recipe only): alone it is the
        reward (``name``, ``path``, ``kwargs`` and ``batched`` unset), or it is added to ``terms``.
    stream_prompts: the ``rl`` recipe generates a step in parts of this many prompts and scores each
        part on a thread of its own while the next generates (``trellis_algos.rl.streaming``); 0
        scores the whole batch once generated. The scores are the same either way.
    judge: a judge model trellis serves for the ``judge`` rewards that name no url
        (:class:`JudgeEngineConfig`, the ``rl`` recipe only).
    """

    name: Optional[str] = None  # noqa: UP045 (unset: gsm8k, unless reward.model or reward.terms is the reward)
    path: Optional[str] = None  # noqa: UP045 (omegaconf needs typing.Optional on Python 3.10)
    fail_fast: bool = False
    batched: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_concurrency: Optional[int] = ranged(None, ge=1)  # noqa: UP045
    max_error_rate: float = ranged(0.1, ge=0, le=1)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    terms: list[RewardTerm] = field(default_factory=list)
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    stream_prompts: int = ranged(0, ge=0)
    judge: JudgeEngineConfig = field(default_factory=JudgeEngineConfig)

    def __post_init__(self) -> None:
        self.terms = [t if isinstance(t, RewardTerm) else RewardTerm(**t) for t in self.terms]
        if isinstance(self.model, dict):
            self.model = RewardModelConfig(**self.model)
        if isinstance(self.judge, dict):
            self.judge = JudgeEngineConfig(**self.judge)


# metric names of their own under reward/, which a term's key must not take
RESERVED_KEYS = ("mean", "max", "min", "errors", "error_rate", "overlong_penalty_mean")


def check_terms(cfg: RewardConfig) -> None:
    """``reward.terms`` that can be summed: not mixed with a top-level reward, each with a name and
    a key of its own. Raises a ``RewardError`` naming the key and the fix."""
    if not cfg.terms:
        return
    if cfg.path or cfg.kwargs or cfg.batched or cfg.name is not None:
        raise RewardError(
            f"reward.terms is set together with reward.name={cfg.name!r}, path={cfg.path!r}, kwargs={cfg.kwargs}, batched={cfg.batched}; "
            "with terms, give each reward as a term (reward.terms[i].name, .path, .kwargs) and leave those unset (reward.name=null)"
        )
    seen: dict[str, int] = {}
    for i, term in enumerate(cfg.terms):
        if not term.name:
            raise RewardError(f"reward.terms[{i}].name is empty; name a registered reward (e.g. judge) or a function in reward.terms[{i}].path")
        key = term.key or term.name
        if key in RESERVED_KEYS or "/" in key:
            raise RewardError(f"reward.terms[{i}] has key {key!r}, a metric of its own or holding '/'; set reward.terms[{i}].key to another name")
        if key in seen:
            raise RewardError(
                f"reward.terms[{i}] and reward.terms[{seen[key]}] both log as reward/{key}; give one of them its own reward.terms[{i}].key"
            )
        seen[key] = i


def check_reward(node: Any, registry: Any, recipe: str = "", services: Sequence[type[RewardService]] = ()) -> None:
    """A recipe's ``reward`` section checked before any model is built: the function resolved
    (:func:`resolve_reward`) and, when it has a ``preflight`` attribute, that called with the
    section's ``kwargs`` (a reward served elsewhere checks that its address answers). Raises a
    ``ConfigError`` with the fix. ``recipe``: the recipe's name; only ``rl`` builds a reward
    model (``reward.model``). ``services``: the reward services the run starts (:class:`RewardService`);
    the sources they will answer are checked by their ``offline_preflight`` instead."""
    cfg = instantiate_options(node, RewardConfig)
    try:
        check_terms(cfg)
    except RewardError as exc:
        raise ConfigError(f"config key 'reward.terms': {exc}") from None
    if cfg.judge.engine and recipe != "rl":
        raise ConfigError(
            f"config key 'reward.judge.engine' is {cfg.judge.engine!r}, but recipe {recipe!r} serves no judge model "
            "(the rl recipe does); unset reward.judge.engine and give each judge's kwargs.url"
        )
    if cfg.model.path and recipe != "rl":
        raise ConfigError(
            f"config key 'reward.model.path' is {cfg.model.path!r}, but recipe {recipe!r} builds no reward-model role "
            "(the rl recipe does); unset reward.model.path and score with a function"
        )
    if cfg.model.path and not cfg.terms:
        if cfg.path or cfg.kwargs or cfg.batched or cfg.name is not None:
            raise ConfigError(
                f"config key 'reward.model.path' is set together with reward.name={cfg.name!r}, path={cfg.path!r}, kwargs={cfg.kwargs}, "
                f"batched={cfg.batched}; the reward model alone is the reward: unset those (reward.name=null), or give the functions as reward.terms "
                "to add the reward model's score to them"
            )
        return
    named = [(f"reward.terms[{i}].name", t) for i, t in enumerate(cfg.terms)] or [("reward", cfg)]
    served = {id(source): supplied for service in services for source, supplied in service.served(cfg)}
    for key, source in named:
        try:
            fn = resolve_reward(source, registry, served.get(id(source), ()))
        except (RewardError, RegistryError) as exc:
            raise ConfigError(f"config key {key!r}: {exc}") from None
        # a source a service of the run answers has no server yet: the checks that need none
        preflight = getattr(fn, "offline_preflight" if id(source) in served else "preflight", None)
        if preflight is not None:
            try:
                preflight(**dict(source.kwargs or {}))
            except Exception as exc:  # noqa: BLE001 - any failure of the check is the user's to fix
                raise ConfigError(f"config key {key!r}: reward {source.name!r} is not ready: {exc}") from None


def reward_name(source: RewardConfig | RewardTerm) -> str:
    """The reward function a source names: its ``name``, or gsm8k where ``reward.name`` is left unset."""
    return source.name or DEFAULT_REWARD


def resolve_reward(cfg: RewardConfig | RewardTerm, registry: Any, supplied: Sequence[str] = ()) -> Callable[..., Any]:
    """The reward function ``cfg`` (a config or one of its terms) names, with ``cfg.kwargs`` and
    the keyword arguments a reward service will add (``supplied``, their names) checked against its
    signature.

    Call it while checking a config: it builds nothing and fails with the fix.
    """
    name = reward_name(cfg)
    if cfg.path:
        fn = load_function(cfg.path, name)
        where = f"{name!r} from {cfg.path!r}"
    else:
        fn = registry.get("reward", name).obj
        where = f"{name!r}"
    kwargs = dict(cfg.kwargs or {})
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn
    batched = cfg.batched or getattr(fn, "batched", False)
    probe = ("data_source", "solution_str", "ground_truth", "extra_info")
    if batched:
        probe = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
    try:
        sig.bind(**dict.fromkeys(probe), **dict.fromkeys(supplied), **kwargs)
    except TypeError as exc:
        served = f" and the served {', '.join(supplied)}" if supplied else ""
        # verl's GenRM functions take the reward router a served reward model answers at
        router = "reward_router_address" in sig.parameters and "reward_router_address" not in supplied
        hint = "; it asks for verl's reward router: serve the model with reward.judge.engine and reward.judge.model" if router else ""
        raise RewardError(
            f"reward {where} cannot be called as {fn.__name__}({', '.join(probe)}, **reward.kwargs) with "
            f"reward.kwargs={kwargs}{served}: {exc}; its parameters are ({', '.join(sig.parameters)}){hint}"
        ) from None
    return fn


@dataclass(frozen=True)
class ServiceContext:
    """What a reward service is started with: the ``run`` (``trellis.Run``: ``spawn`` a role of the
    service's own) and the policy's ``tokenizer``; the run's ``registry``, config ``cfg`` (a
    ``DictConfig``) and ``seed`` are read through it."""

    run: Any
    tokenizer: Any

    @property
    def registry(self) -> Any:
        return self.run.registry

    @property
    def cfg(self) -> Any:
        return self.run.cfg

    @property
    def seed(self) -> int:
        return self.run.cfg.seed


class RewardService(Protocol):
    """A service the ``rl`` recipe starts for its reward (kind ``reward_service``; trellis-judges'
    ``judge_engine`` serves ``reward.judge``, its ``reward_model`` scores with ``reward.model``):
    every registered one the reward config asks for (``wanted``) is started, in name order. The
    classmethods run before any model is built."""

    @classmethod
    def wanted(cls, reward: RewardConfig) -> bool:
        """Whether the run's reward config asks for this service."""

    @classmethod
    def check(cls, cfg: Any, registry: Any) -> None:
        """Refuse the run's config (a ``DictConfig``) where the service cannot serve it, naming the key and the fix."""

    @classmethod
    def served(cls, reward: RewardConfig) -> list[tuple[Any, tuple[str, ...]]]:
        """The reward sources (the section or its terms) the service will answer once started, each
        with the names of the keyword arguments it will add to their calls."""

    def __init__(self, reward: RewardConfig, context: ServiceContext) -> None:
        """Start the service for the run; ``self.reward`` is then ``reward`` with its sources pointed at it."""

    def wrap(self, scorer: Scorer) -> Scorer:
        """The run's scorer, with the service's own figures added to each result, or the service's
        own scorer (a reward model's score, alone or added to ``scorer``'s)."""

    def close(self) -> None:
        """Stop the service (the run ends, also on an error)."""


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, penalty: float) -> torch.Tensor:
    """``(batch,)`` DAPO's soft overlong punishment for responses of ``lengths`` ``(batch,)`` tokens
    (Yu et al., "DAPO", arXiv:2503.14476, section 3.4, eq. 13, there with ``penalty`` 1):
    0 up to ``max_len - buffer_len`` tokens, then ``(max_len - buffer_len - L) / buffer_len * penalty``,
    falling linearly to ``-penalty`` at ``max_len`` (and held there beyond it)."""
    over = (lengths.float() - (max_len - buffer_len)).clamp(0, buffer_len)
    return -over / buffer_len * penalty


def add_overlong_penalty(scored: RewardResult, response_mask: torch.Tensor, max_len: int, buffer_len: int, penalty: float) -> RewardResult:
    """``scored`` with :func:`overlong_penalty` of each response's length (its ``response_mask``
    ``(batch, response_len)`` ones) added to its score and to its last valid token's score; the
    penalty's mean is the metric ``reward/overlong_penalty_mean``."""
    shaped = overlong_penalty(response_mask.sum(-1), max_len, buffer_len, penalty)
    token_scores = scored.token_scores.clone()
    last = last_valid_index(response_mask)
    rows = (last >= 0).nonzero().flatten()
    token_scores[rows, last[rows]] += shaped[rows]
    metrics = {**scored.metrics, "reward/overlong_penalty_mean": float(shaped.mean())}
    return RewardResult(token_scores, metrics, scored.scores + shaped, scored.components)


@dataclass
class Evaluation:
    """Per-sample results of scoring (a part of) a batch, before the batch's figures: ``scores``
    and ``failed`` ``(n,)``, ``components`` {key: ``(n,)``} and ``extras`` (each key's values over
    the samples that returned it, for its mean)."""

    scores: torch.Tensor
    failed: torch.Tensor
    components: dict[str, torch.Tensor]
    extras: dict[str, list[float]]


class _Scorer:
    """One reward function with its kwargs: called per sample (in a pool of ``max_concurrency``
    threads when above 1) or once per batch. ``key`` and ``weight``: its term's, or None and 1."""

    def __init__(self, source: RewardConfig | RewardTerm, registry: Any, max_concurrency: int | None, key: str | None, weight: float) -> None:
        self.fn = resolve_reward(source, registry)
        self.kwargs = dict(source.kwargs or {})
        self.batched = bool(source.batched or getattr(self.fn, "batched", False))
        name = reward_name(source)
        self.name = f"{name} ({source.path})" if source.path else name
        self.key, self.weight = key, float(weight)
        self.awaited = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(type(self.fn).__call__)
        limit = max_concurrency if max_concurrency is not None else getattr(self.fn, "max_concurrency", 0 if self.awaited else 1)
        if limit == 0 and self.awaited:
            self.max_concurrency = 0  # every sample at once
            return
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise RewardError(f"reward.max_concurrency={limit!r} for reward {self.name!r}; give a whole number >= 1 (1 = one sample at a time)")
        self.max_concurrency = limit


class RewardManager:
    """Scores a batch of responses with the reward ``cfg`` names, or the weighted sum of its ``terms``.

    ``manager(batch) -> (token_scores, metrics)``; ``manager.score(batch)`` returns a
    :class:`RewardResult` that adds the per-sample ``scores`` ``(batch,)``.

    The batch needs ``responses`` and ``response_mask`` ``(batch, response_len)`` (right-padded;
    in multi-turn, environment tokens have mask 0), ``data_source`` and ``ground_truth`` (or
    ``reward_model``), and optionally ``extra_info``. A response is decoded from its first token
    up to its last mask-1 token (environment tokens between model turns included, as verl does)
    with special tokens skipped, and its score goes on that last mask-1 token.

    A function that raises (or returns no number) scores the sample 0, counts in ``reward/errors``
    and has its first traceback logged (once per manager); with ``fail_fast`` it raises
    :class:`RewardError` naming the sample index and data source, and when the batch's share of
    failures is above ``max_error_rate`` it raises one that gives the share.

    With a ``max_concurrency`` above 1 (``cfg.max_concurrency``, else the function's attribute of
    that name) the per-sample calls run in a thread pool of that size; scores keep the batch order.

    With ``terms`` each term is scored in turn; a sample's score is the sum of ``weight * score``,
    each term's unweighted score is the component ``<key>`` and the metric ``reward/<key>`` (its
    mean over the batch), and a number a term's dict returns besides ``score`` is ``<key>/<name>``.
    """

    def __init__(self, cfg: RewardConfig, registry: Any, tokenizer: Any) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        check_terms(cfg)
        if cfg.terms:
            self.scorers = [_Scorer(t, registry, cfg.max_concurrency, t.key or t.name, t.weight) for t in cfg.terms]
        else:
            self.scorers = [_Scorer(cfg, registry, cfg.max_concurrency, None, 1.0)]
        self.name = " + ".join(f"{s.weight:g}*{s.key}" for s in self.scorers) if cfg.terms else self.scorers[0].name
        self._logged_error = False
        self._last_error = ""  # the latest failure, named when a batch's failures stop the run
        self._error_lock = threading.Lock()

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        result = self.score(batch)
        return result.token_scores, result.metrics

    def score(self, batch: Batch) -> RewardResult:
        return self.finish(batch, [self.evaluate(batch)])

    def evaluate(self, batch: Batch) -> Evaluation:
        """Every term's value for each sample of ``batch`` (a whole batch, or a part of one that
        :meth:`finish` puts together with the others)."""
        responses, mask = batch["responses"], batch["response_mask"]
        n = len(batch)
        last = last_valid_index(mask)
        solutions = [self.tokenizer.decode(responses[i, : last[i] + 1].tolist(), skip_special_tokens=True) for i in range(n)]
        data_sources = list(batch["data_source"]) if "data_source" in batch else _missing(batch, "data_source")
        ground_truths = _ground_truths(batch)
        extra_infos = list(batch["extra_info"]) if "extra_info" in batch else [None] * n

        out = Evaluation(torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.bool), {}, {})
        for scorer in self.scorers:
            if scorer.batched:
                raw = self._call_batched(scorer, data_sources, solutions, ground_truths, extra_infos)
            elif scorer.awaited:
                raw = _run_coroutine(self._await_all(scorer, data_sources, solutions, ground_truths, extra_infos))
            elif scorer.max_concurrency > 1 and n > 1:
                with ThreadPoolExecutor(min(scorer.max_concurrency, n), thread_name_prefix="trellis-reward") as pool:
                    raw = list(pool.map(partial(self._call_one, scorer), range(n), data_sources, solutions, ground_truths, extra_infos))
            else:
                raw = [self._call_one(scorer, i, data_sources[i], solutions[i], ground_truths[i], extra_infos[i]) for i in range(n)]
            values = torch.zeros(n, dtype=torch.float32)
            for i, r in enumerate(raw):
                if isinstance(r, _Failed):
                    out.failed[i] = True
                    continue
                try:
                    value, extra = _as_score(r)
                except RewardError as exc:
                    out.failed[i] = True
                    self._failed(scorer, i, data_sources[i], exc)
                    continue
                values[i] = value
                for k, v in extra.items():
                    k = k if scorer.key is None else f"{scorer.key}/{k}"
                    out.extras.setdefault(k, []).append(v)
                    out.components.setdefault(k, torch.zeros(n, dtype=torch.float32))[i] = v
            out.scores += scorer.weight * values
            if scorer.key is not None:
                out.components[scorer.key] = values
                out.extras[scorer.key] = values.tolist()
        return out

    def finish(self, batch: Batch, parts: list[Evaluation]) -> RewardResult:
        """The reward of ``batch`` from the evaluations of its parts, in order: token scores, the
        batch's figures and the error-rate check."""
        mask = batch["response_mask"]
        n = len(batch)
        scores = torch.cat([p.scores for p in parts])
        failed = torch.cat([p.failed for p in parts])
        keys = list(dict.fromkeys(k for p in parts for k in p.components))
        components = {k: torch.cat([p.components.get(k, torch.zeros(len(p.scores))) for p in parts]) for k in keys}
        extras = {k: [v for p in parts for v in p.extras.get(k, [])] for k in dict.fromkeys(k for p in parts for k in p.extras)}
        scores[failed] = 0.0  # a sample that failed in any term has no score, not a partial sum
        errors = int(failed.sum())

        last = last_valid_index(mask)
        token_scores = torch.zeros(mask.shape, dtype=torch.float32)
        rows = torch.nonzero(last >= 0).flatten()
        token_scores[rows, last[rows]] = scores[rows]
        metrics = {**reward_figures(scores), "reward/errors": float(errors), "reward/error_rate": errors / n if n else 0.0}
        if n and errors / n > self.cfg.max_error_rate:
            raise RewardError(
                f"reward {self.name!r} failed on {errors} of {n} samples ({errors / n:.0%}), above reward.max_error_rate="
                f"{self.cfg.max_error_rate:g} (the last: {self._last_error}); the first failure's traceback is logged above; "
                "fix the reward or raise reward.max_error_rate"
            )
        metrics.update({f"reward/{k}": sum(v) / len(v) for k, v in extras.items() if v})
        return RewardResult(token_scores, metrics, scores, components)

    def _call_one(self, scorer: _Scorer, i: int, data_source: Any, solution: str, ground_truth: Any, extra_info: Any) -> Any:
        try:
            return scorer.fn(data_source=data_source, solution_str=solution, ground_truth=ground_truth, extra_info=extra_info, **scorer.kwargs)
        except Exception as exc:
            self._failed(scorer, i, data_source, exc)
            return _Failed()

    async def _await_all(self, scorer: _Scorer, data_sources: list, solutions: list[str], ground_truths: list, extra_infos: list) -> list[Any]:
        """An ``async def`` reward awaited for every sample, at most ``max_concurrency`` at once (0: all)."""
        gate = asyncio.Semaphore(scorer.max_concurrency or len(solutions) or 1)

        async def one(i: int) -> Any:
            async with gate:
                try:
                    sample = {"data_source": data_sources[i], "solution_str": solutions[i], "ground_truth": ground_truths[i]}
                    return await scorer.fn(**sample, extra_info=extra_infos[i], **scorer.kwargs)
                except Exception as exc:
                    self._failed(scorer, i, data_sources[i], exc)
                    return _Failed()

        return list(await asyncio.gather(*(one(i) for i in range(len(solutions)))))

    def _call_batched(self, scorer: _Scorer, data_sources: list, solutions: list[str], ground_truths: list, extra_infos: list) -> list[Any]:
        n = len(solutions)
        try:
            out = scorer.fn(data_sources=data_sources, solution_strs=solutions, ground_truths=ground_truths, extra_infos=extra_infos, **scorer.kwargs)
            out = list(_run_coroutine(out) if inspect.isawaitable(out) else out)
            if len(out) != n:
                raise RewardError(f"batched reward {scorer.name!r} returned {len(out)} scores for {n} samples")
            return out
        except Exception as exc:
            self._failed(scorer, None, data_sources[0] if data_sources else None, exc)
            return [_Failed() for _ in range(n)]

    def _failed(self, scorer: _Scorer, i: int | None, data_source: Any, exc: Exception) -> None:
        what = f"sample {i} (data_source={data_source!r})" if i is not None else "a batch"
        if self.cfg.fail_fast:
            raise RewardError(f"reward {scorer.name!r} failed on {what}: {type(exc).__name__}: {exc} (reward.fail_fast=true)") from exc
        with self._error_lock:
            first, self._logged_error = not self._logged_error, True
            self._last_error = f"{type(exc).__name__}: {str(exc)[:300]}"
        if first:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            logger.error(
                "reward %r failed on %s; it scores 0 and counts in reward/errors (later failures are counted, not logged; "
                "set reward.fail_fast=true to stop instead)\n%s",
                scorer.name,
                what,
                tb,
            )


class _Failed:
    """Marks a sample whose reward function raised."""


def _run_coroutine(coroutine: Any) -> Any:
    """Run ``coroutine`` to its end on an event loop of its own (in a thread of its own when this
    thread already runs one, as a reward called from async code would)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1, thread_name_prefix="trellis-reward-loop") as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _as_score(result: Any) -> tuple[float, dict[str, float]]:
    extra: dict[str, float] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardError(f"the reward returned a dict without 'score' (keys: {sorted(result)}); return a number or a dict with 'score'")
        for k, v in result.items():
            if k != "score" and _is_number(v):
                extra[k] = float(v)
        result = result["score"]
    if not _is_number(result):
        raise RewardError(f"the reward returned {result!r:.100}, not a number; return a float or a dict with 'score'")
    value = float(result)
    if not math.isfinite(value):
        raise RewardError(f"the reward returned {value}; return a finite number")
    return value, extra


def _is_number(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    if isinstance(v, (bool, int, float)):
        return True
    return type(v).__module__ == "numpy" and hasattr(v, "item") and getattr(v, "size", 0) == 1


def _ground_truths(batch: Batch) -> list[Any]:
    if "ground_truth" in batch:
        return list(batch["ground_truth"])
    if "reward_model" in batch:
        return [(rm or {}).get("ground_truth") for rm in batch["reward_model"]]
    return _missing(batch, "ground_truth")


def _missing(batch: Batch, key: str) -> list[Any]:
    raise RewardError(
        f"the batch has no {key!r} for the reward (fields: {sorted(batch.keys())}); load prompts with "
        "trellis_algos.PromptDataset, whose batches carry data_source and ground_truth"
    )
