"""Where the ``rl`` recipe's samples come from: one :class:`SampleSource` makes each step's batch
(generate through the rollout, score, shape, refill dropped groups), inline or ahead of training
(the producer), and holds the prompt loader's position checkpoints keep."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from trellis import Batch, RewardResult, RolloutGroup, Run, SamplingParams, Scorer, instantiate_options
from trellis.kit.recipe import StageTimer, backend_mesh, pad_id, reward_figures, stop_ids
from trellis_algos.prompts import PromptLoader
from trellis_algos.rewards import RewardConfig, RewardManager, ServiceContext, add_overlong_penalty, reward_name
from trellis_algos.rl.ahead import Produced, Producer, TrainedPosition, partial_chunk
from trellis_algos.rl.checks import reward_services
from trellis_algos.rl.dynamic_sampling import fill, group_filters
from trellis_algos.rl.multi_turn import ConversationRollout
from trellis_algos.rl.partial import generate_in_chunks
from trellis_algos.rl.streaming import generate_scored

log = logging.getLogger(__name__)
ZERO_ROUNDS = 3  # all-zero rounds with the overlong penalty on before the warning
# batch fields holding the reward's per-sample components, for estimators that need them (gdpo)
COMPONENT = "reward_component_"


@dataclass
class StepSamples:
    """A step's samples: ``batch`` with ``token_scores`` (None when dynamic sampling kept no
    group), the sampling ``params`` of the step, the first generation round's reward result
    (``first``: the unfiltered draw the reward metrics describe) and dynamic sampling's metrics."""

    batch: Batch | None
    params: SamplingParams
    first: RewardResult
    metrics: dict[str, float]

    def state_dict(self) -> dict[str, Any]:
        """In the types a checkpoint reads back with ``weights_only``."""
        batch = None if self.batch is None else self.batch.state_dict()
        return {"batch": batch, "params": dataclasses.asdict(self.params), "first": self.first._asdict(), "metrics": self.metrics}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> StepSamples:
        batch = None if state["batch"] is None else Batch.from_state_dict(state["batch"])
        return cls(batch, SamplingParams(**state["params"]), RewardResult(**state["first"]), state["metrics"])


class MadeAhead:
    """What checkpoints keep of a run generating ahead under the exact schedule: the steps made
    and not yet trained (their weights are gone by a resume, so they cannot be made again), the
    loader's position after their prompts and the groups carried past them. A resumed run trains
    on the very samples an uninterrupted one does, and makes the next steps from the same state."""

    def __init__(self, source: SampleSource) -> None:
        self.source = source
        self.resumed: list[Produced] = []  # a checkpoint's steps, handed to the producer first

    def state_dict(self) -> dict[str, Any]:
        source = self.source
        made = source.ahead.settled() if source.ahead is not None else []
        return {
            "loader": source.loader.state_dict(),
            "made": [p.state_dict(StepSamples.state_dict) for p in made],
            "carry": [(batch.state_dict(), scored._asdict()) for batch, scored in source.carry],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        source = self.source
        if "made" not in state:  # a checkpoint from before the steps made ahead were kept: the loader alone
            source.loader.load_state_dict(state)
            return
        source.loader.load_state_dict(state["loader"])
        self.resumed = [Produced.from_state_dict(p, StepSamples.from_state_dict) for p in state["made"]]
        source.carry[:] = [(Batch.from_state_dict(batch), RewardResult(**scored)) for batch, scored in state["carry"]]

    def took(self, produced: Produced) -> None:
        """The trainer took ``produced`` (nothing to note: the producer's state is read when saved)."""


class SampleSource:
    """Each step's samples, from the loader's next prompts: generated (single-turn, through the
    rows' agent loops, or in chunks a weight sync may go between), scored while generating or
    after, shaped (the overlong penalty), refilled when group filters drop groups (kept groups a
    step ahead did not need carried to the next), plus what the estimator declares it needs
    (reward components, a greedy baseline). With ``bound`` (``trainer.async_mode``) a producer
    thread makes them up to ``bound`` steps ahead; :attr:`position` is what checkpoints keep."""

    def __init__(self, cfg: DictConfig, run: Run, rollout: RolloutGroup, loader: PromptLoader, agent: ConversationRollout | None,
                 reward_fn: Scorer, tokenizer, estimator_needs: tuple[str, ...], bound: int | None) -> None:  # fmt: skip
        self.cfg, self.run, self.rollout, self.loader, self.agent = cfg, run, rollout, loader, agent
        self.reward_fn, self.tokenizer, self.needs, self.bound = reward_fn, tokenizer, estimator_needs, bound
        self.scorer = scorer_of(reward_fn, agent, cfg.reward.max_error_rate)
        self.sampling = SamplingParams(**cfg.sampling, return_routed_experts=cfg.actor.router_replay != "off")
        self.samples_per_step = cfg.data.train_batch_prompts * cfg.sampling.n
        self.dynamic = cfg.algorithm.dynamic_sampling
        self.multiple = group_multiple(cfg, run.registry, self.samples_per_step) if self.dynamic.enable else 1
        self.filters = group_filters(self.dynamic, run.registry)
        self.carry: list[tuple[Batch, RewardResult]] = []  # kept groups a step ahead of training did not need
        self.chunk = partial_chunk(cfg.trainer, cfg.multi_turn.enable)
        self.stops = stop_ids(cfg.model.path, tokenizer) if self.chunk is not None else set()  # where a chunked sample ends
        # generating ahead, checkpoints keep the steps made ahead (exact schedule), else the loader's
        # position after the last trained step (the steps ahead are made again on resume)
        self.position = loader if bound is None else MadeAhead(self) if cfg.trainer.async_schedule == "exact" else TrainedPosition(loader)
        self.zero_rounds: int | None = 0  # rounds whose samples all scored 0 (None: no longer watched)
        self.ahead: Producer | None = None

    @contextlib.contextmanager
    def from_step(self, first: int):
        """Steps ``first`` .. ``trainer.total_steps`` are taken inside; ahead of training, the
        producer thread runs meanwhile (and stops on leaving)."""
        if self.bound is None:
            yield self
            return
        made = self.position.resumed if isinstance(self.position, MadeAhead) else []
        with Producer(self.make, self.loader, first, self.cfg.trainer.total_steps, self.bound, made) as self.ahead:
            yield self

    def take(self, step: int) -> tuple[StepSamples, dict[str, float]]:
        """Step ``step``'s samples and the figures of their hand-over (ahead of training: the
        producer's stage timings and waits)."""
        if self.ahead is None:
            with self.run.generating(self.rollout):
                return self.make(step, self.run.timer), {}
        produced, handover = self.ahead.take(step)
        self.position.took(produced)
        return produced.value, {**handover, **produced.timings, "timing/wait_trainer_s": produced.waited_s}

    def before_sync(self, version: int) -> None:
        """Before the engines take weight ``version``: under the exact schedule (ahead of training)
        wait until every step that generates from the version before it was made."""
        if self.ahead is not None and self.cfg.trainer.async_schedule == "exact":
            self.ahead.made(version + self.bound)

    def finished(self, step: int) -> None:
        """The trainer finished ``step``: the producer may start the steps it held back."""
        if self.ahead is not None:
            self.ahead.finished(step)

    def make(self, step: int, timer: StageTimer) -> StepSamples:
        """Step ``step``'s prompts, samples and rewards (the loader's next prompts)."""
        params = self.sampling.at_step(step, self.samples_per_step)
        made = self._refilled(step, timer) if self.dynamic.enable else self._drawn(params, timer)
        batch = made.batch
        if batch is None:
            return StepSamples(None, params, made.first, made.metrics)
        if "reward_components" in self.needs:
            for key, values in (made.scored.components or {}).items():
                batch[COMPONENT + key] = values
        if "greedy_baseline" in self.needs:  # one draw of prompts: dynamic sampling is refused with it
            with timer("gen_greedy"):
                greedy = self.rollout.generate(made.prompts, SamplingParams(**{**params.__dict__, "n": 1, "greedy": True}))
                by_uid = dict(zip(greedy["uid"], self.reward_fn.score(greedy).scores.tolist()))
                batch["baseline_rewards"] = torch.tensor([by_uid[u] for u in batch["uid"]])
        return StepSamples(batch, params, made.first, made.metrics)

    def _drawn(self, params: SamplingParams, timer: StageTimer) -> _Made:
        prompts = self.loader.next_batch()
        batch, scored = self._generate(prompts, params, timer)
        batch["token_scores"] = scored.token_scores
        return _Made(batch, scored, scored, {}, prompts)

    def _refilled(self, step: int, timer: StageTimer) -> _Made:
        """Rounds of fresh prompts until the filters keep a step's groups (carried ones first)."""
        dynamic, bound = self.dynamic, self.bound

        # a round's seeds move on past every earlier round's, this step's and the steps' before it
        def round_at(r: int) -> tuple[Batch, RewardResult]:
            params = self.sampling.at_step((step - 1) * dynamic.max_rounds + r + 1, self.samples_per_step)
            return self._generate(self.loader.next_batch(), params, timer)

        # generating ahead, the groups an earlier step kept beyond its need come first while fresh enough
        # (only runs that generate ahead carry any)
        carried = [p for p in self.carry if int(p[0]["weight_version"].min()) >= step - 1 - (bound or 0)]
        stale = sum(_groups(b) for b, _ in self.carry) - sum(_groups(b) for b, _ in carried)
        filled = fill(round_at, self.cfg.data.train_batch_prompts, dynamic, step, self.multiple, self.filters, carried)
        self.carry[:] = filled.leftover if bound is not None else []
        metrics = {**filled.metrics, **({"dynamic_sampling/stale_groups_dropped": float(stale)} if bound is not None else {})}
        if filled.batch is None:  # nothing to train on
            return _Made(None, filled.first, None, metrics)
        scored = RewardResult(filled.batch["token_scores"], {}, filled.scores, filled.components)
        # carried groups alone filled the step: the reward figures describe them
        first = filled.first or RewardResult(scored.token_scores, reward_figures(scored.scores), scored.scores, scored.components)
        return _Made(filled.batch, first, scored, metrics)

    def _generate(self, prompts: Batch, params: SamplingParams, timer: StageTimer) -> tuple[Batch, RewardResult]:
        cfg = self.cfg
        if cfg.reward.stream_prompts:  # each part scored while the next generates
            batch, scored = generate_scored(self.rollout, prompts, params, self.reward_fn, cfg.reward.stream_prompts, timer)
        else:
            with timer("gen"):
                if self.chunk is None:
                    batch = sample(self.rollout, prompts, params, self.agent)
                else:  # a weight sync may go in between two chunks
                    every = self.stops | set(params.stop_token_ids)
                    batch = generate_in_chunks(self.rollout, prompts, params, self.chunk, every, pad_id(self.tokenizer), self.rollout.let_syncs_in)
            with timer("reward"):
                scored = self.scorer.score(batch)
        overlong = cfg.reward.overlong
        if overlong.buffer_len:
            self._warn_if_length_alone(scored.scores, batch)
            scored = add_overlong_penalty(scored, batch["response_mask"], cfg.sampling.max_new_tokens, overlong.buffer_len, overlong.penalty)
        return batch, scored

    def _warn_if_length_alone(self, scores: torch.Tensor, batch: Batch) -> None:
        """The reward scored 0 on every sample of the first :data:`ZERO_ROUNDS` rounds while the
        overlong penalty is on: the penalty alone varies within groups (a starter's reward on data it
        cannot score trains response length). Said once; a non-zero score ends the watch."""
        if self.zero_rounds is None:
            return
        self.zero_rounds = None if bool((scores != 0).any()) else self.zero_rounds + 1
        if self.zero_rounds == ZERO_ROUNDS:
            reward = self.cfg.reward
            log.warning(
                "reward %r scored 0 on every sample of the first %d generation rounds (data_source: %s): within each group only "
                "reward.overlong's length penalty differs, so the model learns response length alone; check that reward.name "
                "scores your data's answers",
                f"{reward.path}:{reward_name(reward)}" if reward.path else reward_name(reward),
                ZERO_ROUNDS,
                ", ".join(sorted(set(batch["data_source"]))[:3]),
            )
            self.zero_rounds = None


@dataclass
class _Made:
    """A step's batch before what the estimator needs is added: the batch, the first round's reward
    result, the reward result of the samples kept, the refill metrics and the prompts (of one
    draw; None after refilling)."""

    batch: Batch | None
    first: RewardResult
    scored: RewardResult | None
    metrics: dict[str, float]
    prompts: Batch | None = None


def make_reward(cfg: DictConfig, run: Run, registry, tokenizer) -> Scorer:
    """The run's reward: the functions ``reward`` names, with the reward services it asks for
    (:class:`~trellis.rewards.RewardService`, trellis-judges': ``reward.judge``'s served judge, whose
    judges that name no url go to it; ``reward.model``'s reward-model role) each started, its
    sources pointed at it, and wrapped around the scorer."""
    reward = instantiate_options(cfg.reward, RewardConfig)
    context, started = ServiceContext(run, tokenizer), []
    for service in reward_services(cfg, registry):
        started.append(run.closing(service(reward, context)))
        reward = started[-1].reward
    scorer: Scorer = RewardManager(reward, registry, tokenizer)  # a service may replace it (a reward model alone)
    for served in started:
        scorer = served.wrap(scorer)
    return scorer


def sample(rollout: RolloutGroup, prompts: Batch, params: SamplingParams, agent: ConversationRollout | None) -> Batch:
    """Single-turn generation, or conversations through the agent loops when ``agent`` is given."""
    return rollout.generate(prompts, params) if agent is None else rollout.rollout(prompts, params, agent)


def scorer_of(reward_fn: Scorer, agent: ConversationRollout | None, max_error_rate: float) -> Scorer:
    """The run's reward, or with agent loops the reward of whole conversations (which stops the run
    when more than ``max_error_rate`` of a batch's conversations ended in an error)."""
    return reward_fn if agent is None else agent.scorer(reward_fn, max_error_rate)


def _groups(batch: Batch) -> int:
    return int(batch.group_index("uid").max()) + 1


def group_multiple(cfg: DictConfig, registry, samples_per_step: int) -> int:
    """The prompt groups a step's batch must be a multiple of: its samples shared evenly over the
    data-parallel ranks and cut into whole actor/critic mini-batches."""
    unit = math.lcm(backend_mesh(cfg, registry).dp, *(cfg[role].mini_batch_samples or 1 for role in ("actor", "critic")))
    return unit // math.gcd(unit, cfg.sampling.n)
