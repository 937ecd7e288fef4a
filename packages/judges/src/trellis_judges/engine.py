"""The judge engine (``reward.judge``, reward service ``judge_engine``): a frozen rollout engine the
``rl`` recipe starts itself, served on loopback as OpenAI-compatible ``/v1/chat/completions`` (the
wire format of ``trellis_algos.openai_api``) to the ``judge`` rewards that name no url.

The engine is built and driven by one thread of its own, which runs the server's event loop (an
engine is driven from the thread that built it: vLLM's rule); the reward's threads call the server
over HTTP like any judge server. It lives in the driver process for the whole run, never sleeps and
never takes a weight sync.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig
from transformers import AutoTokenizer

from trellis import Batch, ConfigError, RewardError, RewardResult, RolloutSpec, Scorer, checked_options, instantiate_options, load_function
from trellis_algos import RewardConfig, RewardTerm, ServiceContext, reward_name

if TYPE_CHECKING:
    from trellis_judges.server import JudgeServer

log = logging.getLogger("trellis")


# what the judge engine adds to the calls of what it serves: a judge's server, and a user function's
# reward router as verl names it (the GenRM pattern: a rule-based check that asks a served model)
JUDGE_KWARGS = ("url", "api_key", "model")
ROUTER_KWARGS = ("reward_router_address", "reward_model_tokenizer")


def _sources(cfg: RewardConfig) -> list[tuple[str, RewardConfig | RewardTerm]]:
    return [(f"reward.terms[{i}]", t) for i, t in enumerate(cfg.terms)] or [("reward", cfg)]


def judges(cfg: RewardConfig) -> list[tuple[str, RewardConfig | RewardTerm]]:
    """The registered ``judge`` rewards ``cfg`` uses (the reward itself, or its terms), each with its config key."""
    return [(key, source) for key, source in _sources(cfg) if source.name == "judge" and not source.path]


def served_judges(cfg: RewardConfig) -> list[tuple[str, RewardConfig | RewardTerm]]:
    """The judges that ``reward.judge.engine`` serves: those naming no ``kwargs.url`` (none without an engine)."""
    return [(key, source) for key, source in judges(cfg) if cfg.judge.engine and not (source.kwargs or {}).get("url")]


def routed_functions(cfg: RewardConfig) -> list[tuple[str, RewardConfig | RewardTerm]]:
    """The user's functions (``path``) that ``reward.judge.engine`` serves as verl's reward router:
    those whose parameters name ``reward_router_address`` (verl's GenRM functions). Each call gets
    ``reward_router_address`` (the server's :attr:`~trellis_judges.server.JudgeServer.address`) and
    ``reward_model_tokenizer`` (the judge model's tokenizer), as verl's reward loop passes them."""
    if not cfg.judge.engine:
        return []
    return [(key, source) for key, source in _sources(cfg) if source.path and "reward_router_address" in _parameters(source)]


def _parameters(source: RewardConfig | RewardTerm) -> Any:
    try:
        return inspect.signature(load_function(source.path, reward_name(source))).parameters
    except (RewardError, TypeError, ValueError):
        return {}  # a function that cannot be loaded is named by the reward's own check


def check_judge_engine(cfg: DictConfig, registry: Any) -> None:
    """``reward.judge`` of an ``rl`` config checked before any model is built: an engine with a
    judge to serve, a model folder with a chat template, the engine's options. Raises a
    ``ConfigError`` naming the key and the fix."""
    reward = instantiate_options(cfg.reward, RewardConfig)
    spec = reward.judge
    if not spec.engine:
        if spec.model or spec.options:
            raise ConfigError(
                f"config key 'reward.judge.model' is {spec.model!r} (options {spec.options}) but reward.judge.engine is not set; "
                "set reward.judge.engine to a rollout engine (hf, vllm, sglang) to serve it, or unset reward.judge"
            )
        return
    used, served, routed = judges(reward), served_judges(reward), routed_functions(reward)
    if not used and not routed:
        raise ConfigError(
            f"config key 'reward.judge.engine' is {spec.engine!r}, but no judge reward is in use (reward.name={reward_name(reward)!r}, "
            f"terms {[t.name for t in reward.terms]}) and no function of reward.path takes reward_router_address; score with "
            "reward.name=judge or a term {name: judge}, or give a function of your own that takes reward_router_address and "
            "reward_model_tokenizer (verl's GenRM functions), or unset reward.judge.engine"
        )
    if used and not served and not routed:
        urls = ", ".join(f"{key}.kwargs.url={source.kwargs['url']!r}" for key, source in used)
        raise ConfigError(
            f"config key 'reward.judge.engine' is {spec.engine!r}, but every judge names its own server ({urls}), so the engine "
            "would serve none; drop kwargs.url from the judge the engine should serve, or unset reward.judge.engine"
        )
    for key, source in served:
        asked = (source.kwargs or {}).get("model")
        if asked is not None and asked != spec.model:
            raise ConfigError(
                f"config key '{key}.kwargs.model' is {asked!r}, but this judge is served by reward.judge.engine, whose model is "
                f"reward.judge.model={spec.model!r}; drop {key}.kwargs.model"
            )
    if not spec.model or not (Path(spec.model) / "config.json").is_file():
        raise ConfigError(
            f"config key 'reward.judge.model' is {spec.model!r}, which is not a Hugging Face model folder (no config.json); "
            "give the judge model's folder"
        )
    engine_options(spec, registry)
    if served and not getattr(AutoTokenizer.from_pretrained(spec.model), "chat_template", None):
        raise ConfigError(
            f"config key 'reward.judge.model' is {spec.model!r}, whose tokenizer has no chat template, which the judge's "
            "messages are rendered with; choose an instruction-tuned model folder with chat_template.jinja"
        )


def engine_options(spec: Any, registry: Any) -> Any:
    """The factory of ``spec.engine`` and its options instance from ``reward.judge.options``
    (checked as under ``rollout``; None when the engine declares no options)."""
    entry = registry.get("rollout", spec.engine)
    return entry.obj, checked_options(entry, spec.options, registry, "reward.judge.options")


def start_judge(spec: Any, registry: Any, seed: int) -> JudgeServer:
    """The judge engine ``spec`` (``reward.judge``) names, built and served (see :class:`JudgeServer`)."""
    from trellis_judges.server import JudgeServer  # aiohttp: imported by runs that serve a judge, not by every plugin load

    make_engine, options = engine_options(spec, registry)
    tokenizer = AutoTokenizer.from_pretrained(spec.model)
    build = RolloutSpec(spec.model, options, tokenizer, seed=seed)
    server = JudgeServer(lambda: make_engine(build), tokenizer, spec.model, spec.max_new_tokens, spec.chat_template_kwargs)
    server.start()
    log.info("judge engine %r serving %s at %s", spec.engine, spec.model, server.url)
    return server


def with_served_judges(cfg: RewardConfig, server: JudgeServer) -> RewardConfig:
    """``cfg`` with every judge that names no url sent to ``server`` (its url, bearer token and model
    name), and every routed function given the server as its reward router (:func:`routed_functions`)."""
    extra = {id(source): {"url": server.url, "api_key": server.token, "model": server.name} for _, source in served_judges(cfg)}
    for _, source in routed_functions(cfg):
        extra[id(source)] = {"reward_router_address": server.address, "reward_model_tokenizer": server.tokenizer}

    def point(source: Any) -> Any:
        return dataclasses.replace(source, kwargs={**source.kwargs, **extra[id(source)]}) if id(source) in extra else source

    return dataclasses.replace(point(cfg), terms=[point(t) for t in cfg.terms])


class JudgedReward:
    """A run's reward whose judges ``server`` serves: ``reward.score(batch)`` plus the server's
    figures while the batch was scored, ``judge/<count>`` (``JudgeServer.counts``: requests served,
    requests refused, prompt and completion tokens)."""

    def __init__(self, reward: Scorer, server: JudgeServer) -> None:
        self.reward, self.server = reward, server

    def score(self, batch: Batch) -> RewardResult:
        before = self.server.counts()
        result = self.reward.score(batch)
        after = self.server.counts()
        return result._replace(metrics={**result.metrics, **{f"judge/{k}": float(after[k] - before[k]) for k in after}})


class JudgeEngine:
    """Reward service ``judge_engine``: serves ``reward.judge`` for an ``rl`` run. The classmethods
    run before any model is built; built for the run, it starts the engine and its server."""

    @classmethod
    def wanted(cls, reward: RewardConfig) -> bool:
        return reward.judge.given()

    @classmethod
    def check(cls, cfg: DictConfig, registry: Any) -> None:
        check_judge_engine(cfg, registry)

    @classmethod
    def served(cls, reward: RewardConfig) -> list[tuple[RewardConfig | RewardTerm, tuple[str, ...]]]:
        """The reward sources this service will answer (their preflight cannot reach a server yet),
        each with the keyword arguments it adds."""
        judged = [(source, JUDGE_KWARGS) for _, source in served_judges(reward)]
        return judged + [(source, ROUTER_KWARGS) for _, source in routed_functions(reward)]

    def __init__(self, reward: RewardConfig, context: ServiceContext) -> None:
        self.server = start_judge(reward.judge, context.registry, context.seed)
        self.reward = with_served_judges(reward, self.server)  # the judges it answers point at it

    def wrap(self, scorer: Scorer) -> Scorer:
        return JudgedReward(scorer, self.server)

    def close(self) -> None:
        self.server.close()
