"""Rewards of multi-turn samples: the environment's scores, or the reward function on the whole
trajectory, placed on each sample's last model token."""

from __future__ import annotations

import torch

from trellis import Batch, RewardError, RewardResult, Scorer, last_valid_index
from trellis.kit.multiturn import reward_figures
from trellis_algos import MultiTurnConfig


class ConversationScorer:
    """A :class:`~trellis.rewards.Scorer` of conversations: :func:`score_multiturn` with the run's
    ``multi_turn`` settings and its reward. A batch in which more than ``max_error_rate``
    (``reward.max_error_rate``) of the conversations ended in an error of the agent or the
    environment stops the run: their samples score 0 and train on nothing the model did."""

    def __init__(self, settings: MultiTurnConfig, reward_fn: Scorer, max_error_rate: float) -> None:
        self.settings, self.reward_fn, self.max_error_rate = settings, reward_fn, max_error_rate

    def score(self, batch: Batch) -> RewardResult:
        errors, n = int(batch["env_errors"].sum()), len(batch)
        if n and errors / n > self.max_error_rate:
            raise RewardError(
                f"{errors} of {n} conversations ({errors / n:.0%}) ended in an error of the agent or the environment, above "
                f"reward.max_error_rate={self.max_error_rate:g}; the first one's traceback is logged above; fix the agent or the environment, "
                "or raise reward.max_error_rate"
            )
        return score_multiturn(batch, self.settings, self.reward_fn)


def score_multiturn(batch: Batch, settings: MultiTurnConfig, reward_fn: Scorer) -> RewardResult:
    """``settings.score`` ``reward``: ``reward_fn`` decodes and scores the trajectory (model and
    environment text; ``extra_info["num_turns"]``: the sample's model turns, as verl's reward
    functions get it), its per-sample components kept; ``last`` / ``sum``: the environment's scores
    (no components). Metrics add ``multiturn/...``
    and, where the interaction scored it, ``reward/first_turn_mean`` (the first answer alone,
    i.e. the reward without feedback)."""
    if settings.score == "reward":
        result = reward_unless_agent_scored(batch, reward_fn)
        metrics = dict(result.metrics)
    else:
        scores = environment_scores(batch, settings.score)
        result = RewardResult(last_token_scores(scores, batch["response_mask"]), {}, scores)
        metrics = {"reward/mean": float(scores.mean()), "reward/max": float(scores.max()), "reward/min": float(scores.min())}
    first = [s[0] for s in batch["turn_scores"] if len(s)]
    if first:
        metrics["reward/first_turn_mean"] = sum(first) / len(first)
    return RewardResult(result.token_scores, {**metrics, **multiturn_metrics(batch)}, result.scores, result.components)


def reward_unless_agent_scored(batch: Batch, reward_fn: Scorer) -> RewardResult:
    """``reward_fn`` on the trajectories, except those whose agent loop gave the sample's reward
    (``agent_scored``: a verl loop's ``reward_score``), which keep it, as verl's reward loop does;
    the function's components are 0 for those."""
    scored = batch["agent_scored"] if "agent_scored" in batch else torch.zeros(len(batch), dtype=torch.bool)
    if not scored.any():
        return reward_fn.score(with_num_turns(batch))
    rest = (~scored).nonzero().flatten()
    scores = batch["agent_rewards"].clone()
    metrics, components = {}, {}
    if len(rest):
        part = reward_fn.score(with_num_turns(batch[rest]))
        scores[rest] = part.scores
        metrics = {k: v for k, v in part.metrics.items() if k not in ("reward/mean", "reward/max", "reward/min")}
        for key, values in (part.components or {}).items():
            components[key] = torch.zeros(len(batch), dtype=torch.float32).index_copy(0, rest, values.float())
    metrics |= reward_figures(scores) | {"reward/agent_scored": float(scored.float().mean())}
    return RewardResult(last_token_scores(scores, batch["response_mask"]), metrics, scores, components)


def with_num_turns(batch: Batch) -> Batch:
    """``batch`` with each sample's own copy of its ``extra_info`` holding ``num_turns`` (the
    samples of a prompt share one dict, which stays as it was)."""
    infos = batch["extra_info"] if "extra_info" in batch else [None] * len(batch)
    out = batch[:]
    out["extra_info"] = [{**(info or {}), "num_turns": int(k)} for info, k in zip(infos, batch["num_turns"].tolist())]
    return out


def last_token_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(batch, response_len)`` zeros with ``scores[i]`` on row i's last mask-1 token (a row with
    no model token gets none)."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = last_valid_index(response_mask)
    has = last >= 0
    out[has, last[has]] = scores[has].float()
    return out


def environment_scores(batch: Batch, score: str) -> torch.Tensor:
    """Per-sample scores ``(batch,)`` from the environment: the last interaction turn's score
    (``last``) or their sum (``sum``), plus the sample's tool rewards and the reward its agent loop
    gave it (``openai_agent``: the user's function's return value)."""
    turns = [list(s) for s in batch["turn_scores"]]
    base = [(s[-1] if s else 0.0) if score == "last" else sum(s) for s in turns]
    return torch.tensor(base, dtype=torch.float32) + batch["tool_rewards"] + batch["agent_rewards"]


def multiturn_metrics(batch: Batch) -> dict[str, float]:
    """``multiturn/...``: turns per sample, tool calls and failures, interaction errors, and the
    fraction of samples that ended for each reason."""
    n = max(len(batch), 1)
    out = {
        "multiturn/num_turns_mean": float(batch["num_turns"].float().mean()),
        "multiturn/num_turns_max": float(batch["num_turns"].max()) if len(batch) else 0.0,
        "multiturn/user_turns_mean": float(batch["user_turns"].float().mean()),
        "multiturn/tool_calls": float(batch["tool_calls"].sum()),
        "multiturn/tool_errors": float(batch["tool_errors"].sum()),
        "multiturn/malformed_calls": float(batch["malformed_calls"].sum()),
        "multiturn/env_errors": float(batch["env_errors"].sum()),
    }
    reasons = list(batch["finish_reason"])
    out.update({f"multiturn/finish_{r}": reasons.count(r) / n for r in sorted(set(reasons))})
    return out
