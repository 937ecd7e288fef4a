"""verl's feature switches as trellis settings with verl's semantics: LoRA, DAPO's group filter,
reward manager and overlong buffer, on-policy distillation, the critic's defaults and the async
trainers' keys."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from trellis_verl_compat.rule import ACTOR, AR, MODE, SKIP, Differs, Rule, Source, Unmapped, when


def _lora_modules(value: Any, src: Source) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _lora_rank(value: Any, src: Source) -> Any:
    return int(value) if int(value) > 0 else SKIP


def lora_rules(model: str, trained: str) -> tuple[Rule, ...]:
    """verl's LoRA keys under ``model`` (its model section) as the adapter of trellis's ``trained`` section."""
    return (
        Rule(model + "lora_rank", trained + "adapter.rank", _lora_rank, "0: full weights"),
        Rule(model + "lora_alpha", trained + "adapter.alpha", when(model + "lora_rank"), "with lora_rank"),
        Rule(model + "target_modules", trained + "adapter.target_modules", when(model + "lora_rank", _lora_modules), "all-linear or a list"),
    )


LORA_RULES = lora_rules(AR + "model.", "actor.")

# the reward manager: the older reward_model.reward_manager where set (verl 0.9.1 moves it over its own), else reward.reward_manager.name
MANAGERS = ("reward_model.reward_manager", "reward.reward_manager.name")
# the reward manager's own options (verl 0.9.1's reward.reward_kwargs; reward_model.reward_kwargs before)
MANAGER_KWARGS = ("reward.reward_kwargs", "reward_model.reward_kwargs")


def manager(src: Source) -> str:
    return str(next((src[k] for k in MANAGERS if src.get(k)), "naive"))


def _batched(value: Any, src: Source) -> Any:
    if value == "batch":
        return True
    if value in ("naive", "dapo"):
        return SKIP  # naive: trellis's per-sample call; dapo: its overlong buffer converts from the manager's options
    raise Unmapped(
        f"verl's {value!r} reward manager has no trellis counterpart; trellis scores each sample with reward.name/path "
        "(verl's naive manager), or a whole batch with reward.batched=true (verl's batch manager)"
    )


def _max_len(src: Source) -> int:
    return int(src.get("data.max_response_length") or 0)


def _buffer(cfg: dict[str, Any], max_resp_len: Any, src: Source) -> dict[str, Any]:
    """trellis's ``reward.overlong`` for verl's DAPO manager's overlong buffer ``cfg`` measured
    from ``max_resp_len`` tokens; {} when off."""
    if not cfg or not cfg.get("enable"):
        return {}
    if manager(src) != "dapo":
        raise Unmapped(
            f"verl's {manager(src)!r} reward manager ignores the overlong buffer (only the dapo manager applies it), so the "
            "converted run has none either; set reward_manager=dapo, or reward.overlong.buffer_len by hand"
        )
    out = {"buffer_len": int(cfg.get("len", 0)), "penalty": float(cfg.get("penalty_factor", 1.0))}
    if max_resp_len is not None and int(max_resp_len) != _max_len(src):
        return {
            key: Differs(
                value,
                f"verl's dapo manager measures the buffer back from max_resp_len={max_resp_len} (and keeps falling beyond it); "
                f"trellis's from sampling.max_new_tokens={_max_len(src)}",
            )
            for key, value in out.items()
        }
    return out


def _manager_overlong(key: str) -> Callable[[Any, Source], Any]:
    """One ``reward.overlong`` option from verl's reward-manager options (a dict read whole)."""

    def convert(value: Any, src: Source) -> Any:
        kwargs = dict(value or {})
        return _buffer(kwargs.get("overlong_buffer_cfg") or {}, kwargs.get("max_resp_len"), src).get(key, SKIP)

    return convert


def _manager_rest(value: Any, src: Source) -> Any:
    rest = sorted(set(value or {}) - {"overlong_buffer_cfg", "max_resp_len"})
    if rest:
        raise Unmapped(
            f"verl hands reward_kwargs to the reward manager, not to compute_score; {', '.join(rest)} "
            f"{'is' if len(rest) == 1 else 'are'} none of the dapo manager's (overlong_buffer_cfg, max_resp_len): "
            "a keyword argument for compute_score is custom_reward_function.reward_kwargs (reward.kwargs)"
        )
    return SKIP


def _legacy_overlong(key: str) -> Callable[[Any, Source], Any]:
    """One ``reward.overlong`` option from verl-recipe's ``reward_model.overlong_buffer`` (measured
    from data.max_response_length there)."""

    def convert(value: Any, src: Source) -> Any:
        cfg = {k: src.get("reward_model.overlong_buffer." + k) for k in ("enable", "len", "penalty_factor")}
        return _buffer({k: v for k, v in cfg.items() if v is not None}, None, src).get(key, SKIP)

    return convert


FILTER = "algorithm.filter_groups."


def _metric(value: Any, src: Source) -> Any:
    if value == "acc":
        return "acc"
    if value == "seq_reward" or (value == "seq_final_reward" and not src.get("algorithm.use_kl_in_reward")):
        return "reward"  # the score with the overlong penalty: verl's summed token scores
    if value == "seq_final_reward":
        return Differs("reward", "verl's seq_final_reward has the in-reward KL penalty subtracted; trellis filters on the score before it")
    raise Unmapped(f"verl filters on the reward function's extra key {value!r}; trellis filters on reward (the score) or acc")


def _rounds(value: Any, src: Source) -> Any:
    if int(value) > 0:
        return int(value)
    return Differs(
        SKIP,
        "verl's 0 generates until the batch fills, without a bound; trellis stops after algorithm.dynamic_sampling.max_rounds "
        "(default 10) and trains on the groups kept, with a warning",
    )


DAPO_RULES = (
    Rule(FILTER + "enable", "algorithm.dynamic_sampling.enable", note="DAPO's dynamic sampling"),
    Rule(FILTER + "metric", "algorithm.dynamic_sampling.metric", when(FILTER + "enable", _metric), "acc; seq_reward -> reward"),
    Rule(FILTER + "max_num_gen_batches", "algorithm.dynamic_sampling.max_rounds", when(FILTER + "enable", _rounds), "0 (no bound) -> 10"),
    *(Rule(key, "reward.batched", _batched, "batch -> true; naive, dapo") for key in MANAGERS),
    *(
        rule
        for key in MANAGER_KWARGS
        for rule in (
            Rule(key, "reward.overlong.buffer_len", _manager_overlong("buffer_len"), "overlong_buffer_cfg.len, dapo manager"),
            Rule(key, "reward.overlong.penalty", _manager_overlong("penalty"), "overlong_buffer_cfg.penalty_factor"),
            Rule(key, "reward.kwargs", _manager_rest, "the manager's options: not compute_score's"),
        )
    ),
    Rule("reward_model.overlong_buffer.enable", "reward.overlong.buffer_len", _legacy_overlong("buffer_len"), "with len"),
    Rule("reward_model.overlong_buffer.enable", "reward.overlong.penalty", _legacy_overlong("penalty"), "penalty_factor"),
)

DISTILL = "distillation."
DLOSS = DISTILL + "distillation_loss."
ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def distill_plan(src: Source) -> dict[str, Any]:
    """trellis keys for verl 0.9.1's ``distillation`` section (enabled): the teacher, and either a
    distillation term in the actor's loss or, with ``use_policy_gradient``, the teacher's
    sampled-token reverse KL as the advantage (``reverse_kl_teacher``)."""
    teachers = {k.split(".")[2] for k in src if k.startswith(DISTILL + "teacher_models.") and src[k] is not None}
    if len(teachers) > 1:
        raise Unmapped(f"trellis distils from one teacher (teacher.path); this config names {len(teachers)}: {', '.join(sorted(teachers))}")
    path = next((src[k] for k in src if k.startswith(DISTILL + "teacher_models.") and k.endswith(".model_path") and src[k]), None)
    if not path:
        raise Unmapped("distillation.enabled without distillation.teacher_models.teacher_model.model_path; give the teacher's folder")
    mode, topk = str(src.get(DLOSS + "loss_mode", "k3")), int(src.get(DLOSS + "topk") or 32)
    task, coef = bool(src.get(DLOSS + "use_task_rewards", True)), float(src.get(DLOSS + "distillation_loss_coef", 1.0))
    for clamp in ("loss_max_clamp", "log_prob_min_clamp"):
        if src.get(DLOSS + clamp) is not None:
            raise Unmapped(f"distillation_loss.{clamp} is set; trellis's distillation losses do not clamp")
    if mode not in (*ESTIMATORS, "forward_kl_topk"):
        raise Unmapped(f"verl's distillation loss_mode {mode!r} is unknown; verl 0.9.1 has forward_kl_topk and {', '.join(ESTIMATORS)}")
    if src.get(DLOSS + "use_policy_gradient"):
        if mode == "forward_kl_topk":
            raise Unmapped("verl refuses forward_kl_topk with use_policy_gradient (the gradient sees the sampled token only)")
        if task and src.get("algorithm.adv_estimator", "gae") != "grpo":
            raise Unmapped("distillation with use_task_rewards and use_policy_gradient converts for adv_estimator=grpo only")
        plan: dict[str, Any] = {"teacher.path": path, "algorithm.advantage.name": "reverse_kl_teacher"}
        plan["algorithm.advantage.reward_weight"] = 1.0 / coef if task else 0.0
        why = []
        if mode not in ("k1", "kl"):
            why.append(f"verl's advantage is -{mode}(student, teacher) per token; trellis's is -k1 (log p_student - log p_teacher)")
        if task:
            why.append(
                "verl sums two clipped policy losses (task advantages + coef x distillation); trellis clips one on their sum "
                "(-k1 + reward_weight x grpo, reward_weight = 1/coef), the loss 1/coef of verl's"
            )
        return {k: Differs(v, "; ".join(why)) for k, v in plan.items()} if why else plan
    plan = {
        "teacher.path": path,
        "actor.distill.coef": coef if task else 1.0,
        "actor.distill.use_policy_loss": task,
        "actor.distill.top_k": topk,
        "actor.distill.loss.name": "forward_kl" if mode == "forward_kl_topk" else "reverse_kl",
    }
    if mode == "forward_kl_topk":
        why = f"trellis adds one bucket for the mass outside the teacher's top-{topk} on each side (verl sums over the top-{topk} alone)"
    else:
        why = (
            f"verl's {mode} is a one-token estimate of KL(student || teacher) at the sampled token; trellis computes that "
            f"divergence over the teacher's top-{topk} tokens plus one bucket for the rest"
        )
    return {k: Differs(v, why) for k, v in plan.items()}


def _distill(key: str) -> Callable[[Any, Source], Any]:
    return lambda value, src: distill_plan(src).get(key, SKIP) if value else SKIP


DISTILL_KEYS = (
    "teacher.path",
    "actor.distill.coef",
    "actor.distill.use_policy_loss",
    "actor.distill.top_k",
    "actor.distill.loss.name",
    "algorithm.advantage.name",
    "algorithm.advantage.reward_weight",
)
DISTILL_RULES = tuple(Rule(DISTILL + "enabled", key, _distill(key), "distillation_loss and teacher_models") for key in DISTILL_KEYS)

# verl's critic options interpolated from the actor's (oc.select) when not given; where neither is
# given, trellis's defaults are verl's (1 epoch, no shuffle, token-mean)
CRITIC_FROM_ACTOR = ("ppo_mini_batch_size", "ppo_epochs", "shuffle", "loss_agg_mode")


def critic_defaults(src: Source) -> Source:
    """The critic's options verl takes from the actor's when the critic's are not given."""
    return {"critic." + key: src[ACTOR + key] for key in CRITIC_FROM_ACTOR if src.get("critic." + key) is None and src.get(ACTOR + key) is not None}


ASYNC = "async_training."


def sync_prompts(src: Source) -> int:
    """Prompts between two weight syncs in verl's fully-async trainer: ``trigger_parameter_sync_step``
    local updates, each on ``require_batches`` mini-batches of ``ppo_mini_batch_size`` prompts."""
    return int(src[ACTOR + "ppo_mini_batch_size"]) * int(src[ASYNC + "require_batches"]) * int(src[ASYNC + "trigger_parameter_sync_step"])


def fully_async(convert: Callable[[Any, Source], Any]) -> Callable[[Any, Source], Any]:
    """``convert`` for runs launched by verl's fully-async entry point; elsewhere verl ignores the key."""

    def guarded(value: Any, src: Source) -> Any:
        if src.get(MODE) == "fully_async":
            return convert(value, src)
        if value is False:
            return SKIP  # what trellis does anyway
        raise Unmapped(
            "read by verl's fully-async trainer only, which its entry point chooses "
            "(python3 -m verl.experimental.fully_async_policy.fully_async_main); give the launch script, or --entry with that module"
        )

    return guarded


def _staleness(value: Any, src: Source) -> Any:
    whole = math.ceil(float(value))
    if whole == float(value):
        return whole
    return Differs(
        whole,
        f"verl generates up to {value} of the next sync's samples ahead; trellis bounds whole steps: trainer.max_staleness = "
        f"ceil({value}) = {whole}, the same bound on a sample's age, more samples ahead",
    )


def _partial(value: Any, src: Source) -> Any:
    return bool(value) if float(src.get(ASYNC + "staleness_threshold") or 0) > 0 else SKIP  # verl: no effect at staleness 0


def _opportunistic(value: Any, src: Source) -> Any:
    return "opportunistic" if _partial(value, src) is True else SKIP


ASYNC_RULES = (
    Rule(MODE, "trainer.async_mode", lambda value, src: value if value != "off" else SKIP, "the entry point's mode"),
    Rule(ASYNC + "staleness_threshold", "trainer.async_mode", fully_async(lambda v, s: "fully_async"), "fully-async entry"),
    Rule(ASYNC + "staleness_threshold", "trainer.max_staleness", fully_async(_staleness), "ceil: whole steps"),
    Rule(ASYNC + "partial_rollout", "trainer.partial_rollout", fully_async(_partial), "when staleness_threshold > 0"),
    # verl's syncs land between chunks as training finishes: trellis's exact schedule has no such sync
    Rule(ASYNC + "partial_rollout", "trainer.async_schedule", fully_async(_opportunistic), "where partial rollouts run"),
    Rule(
        ASYNC + "trigger_parameter_sync_step",
        "data.train_batch_prompts",
        fully_async(lambda v, s: sync_prompts(s)),
        "mini x require_batches x trigger",
    ),
    Rule(ASYNC + "require_batches", "data.train_batch_prompts", fully_async(lambda v, s: sync_prompts(s)), "prompts per weight sync"),
)

RC = "algorithm.rollout_correction."


def _rollout_log_probs(value: Any, src: Source) -> Any:
    """verl's old log-probs taken from the engine: trellis's ``bypass_mode`` policy loss (PPO
    against the rollout's log-probs) for the vanilla loss; another loss cannot take them."""
    if not value:
        return SKIP
    if str(src.get(ACTOR + "policy_loss.loss_mode", "vanilla")) in ("vanilla", "bypass_mode"):
        return "bypass_mode"
    raise Unmapped("trellis takes the engine's log-probs as the old ones in its bypass_mode loss only (PPO's clip); this run's loss recomputes them")


ROLLOUT_CORRECTION_RULES = (
    Rule(RC + "rollout_is", "actor.policy_loss.rollout_is", note="token or sequence IS weights"),
    Rule(RC + "rollout_is_threshold", "actor.policy_loss.rollout_is_threshold", when(RC + "rollout_is"), "with rollout_is"),
    Rule(RC + "rollout_is_batch_normalize", "actor.policy_loss.rollout_is_batch_normalize", when(RC + "rollout_is"), "with rollout_is"),
    Rule(RC + "rollout_rs", "actor.policy_loss.rollout_rs", lambda v, s: str(v), "rejection criteria"),
    Rule(RC + "rollout_rs_threshold", "actor.policy_loss.rollout_rs_threshold", when(RC + "rollout_rs", lambda v, s: str(v)), "with rollout_rs"),
    Rule(RC + "bypass_mode", "actor.policy_loss.name", lambda v, s: "bypass_mode" if v else SKIP, "true: the bypass_mode loss"),
    Rule(RC + "loss_type", "actor.policy_loss.loss_type", when(RC + "bypass_mode"), "ppo_clip or reinforce, with bypass_mode"),
    Rule(ACTOR + "use_rollout_log_probs", "actor.policy_loss.name", _rollout_log_probs, "true: the bypass_mode loss"),
    *(Rule(ACTOR + key, "actor.policy_loss." + key, note="sapo") for key in ("tau_pos", "tau_neg")),
)
