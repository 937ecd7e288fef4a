"""Generation ahead of training (``trainer.async_mode``): a producer thread makes the batches of
later steps while the trainer trains on earlier ones, never from weights more than
``max_staleness`` versions behind the step that trains on them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from trellis import ConfigError
from trellis.kit.recipe import StageTimer

log = logging.getLogger("trellis")

MODES = ("off", "one_step", "fully_async")
SCHEDULES = ("exact", "opportunistic")


def staleness_bound(trainer: DictConfig) -> int | None:
    """How many weight versions a step's samples may lag (None: ``off``, generation inline).
    ``one_step`` is 1; ``fully_async`` takes ``trainer.max_staleness`` (default 1)."""
    mode, bound = trainer.async_mode, trainer.max_staleness
    if mode == "off":
        if bound is not None:
            raise ConfigError(
                f"config key 'trainer.max_staleness' is {bound} with trainer.async_mode=off, where samples always come from the "
                "latest weights; set trainer.async_mode=fully_async to let them lag, or remove trainer.max_staleness"
            )
        return None
    if mode == "one_step":
        if bound not in (None, 1):
            raise ConfigError(
                f"config key 'trainer.max_staleness' is {bound} with trainer.async_mode=one_step, which generates one step ahead "
                "(staleness 1); use trainer.async_mode=fully_async for another bound"
            )
        return 1
    return 1 if bound is None else bound


def partial_chunk(trainer: DictConfig, multi_turn: bool) -> int | None:
    """The tokens per chunk of a partial rollout (``trainer.partial_rollout``; default 32), or None
    when generations are not cut: partial rollouts need ``fully_async`` and single-turn sampling."""
    chunk = trainer.rollout_chunk_tokens
    if not trainer.partial_rollout:
        if chunk is not None:
            raise ConfigError(
                f"config key 'trainer.rollout_chunk_tokens' is {chunk} with trainer.partial_rollout=false, where a generation is "
                "never cut; set trainer.partial_rollout=true, or remove trainer.rollout_chunk_tokens"
            )
        return None
    if trainer.async_mode != "fully_async":
        raise ConfigError(
            f"config key 'trainer.partial_rollout' is true with trainer.async_mode={trainer.async_mode}: only generation that runs "
            "ahead of training is cut for a weight sync; set trainer.async_mode=fully_async"
        )
    if trainer.async_schedule == "exact":
        raise ConfigError(
            "config key 'trainer.partial_rollout' is true with trainer.async_schedule=exact, where a step generates from one "
            "version of the weights, so no sync ever lands between two chunks; set trainer.async_schedule=opportunistic (syncs "
            "land as training finishes, the samples depend on timing) or trainer.partial_rollout=false"
        )
    if multi_turn:
        raise ConfigError(
            "config key 'trainer.partial_rollout' is true with multi_turn.enable=true: conversations are not cut into chunks "
            "yet; set trainer.partial_rollout=false (generation still runs ahead of training)"
        )
    return 32 if chunk is None else chunk


@dataclass
class Produced:
    """What the producer made for one step: ``value`` (the recipe's ``make(step)``), the prompt
    loader's position once the step's prompts were taken, the producer's stage timings
    (``timing/gen_s``...) and the seconds it waited for the trainer before starting the step."""

    step: int
    value: Any
    loader_state: dict[str, Any]
    timings: dict[str, float]
    waited_s: float

    def state_dict(self, value_state: Callable[[Any], Any]) -> dict[str, Any]:
        """For a checkpoint, with ``value_state(value)`` the value's plain form."""
        state = {"step": self.step, "loader_state": self.loader_state, "timings": self.timings, "waited_s": self.waited_s}
        return {**state, "value": value_state(self.value)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], value: Callable[[Any], Any]) -> Produced:
        """What :meth:`state_dict` kept, ``value(state)`` rebuilding the value."""
        return cls(state["step"], value(state["value"]), state["loader_state"], state["timings"], state["waited_s"])


class TrainedPosition:
    """The prompt loader's position as checkpoints must keep it: after the last *trained* step's
    prompts, not after what the producer fetched ahead (those steps are generated again on resume)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.trained = loader.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return dict(self.trained)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self.trained = self.loader.state_dict()

    def took(self, produced: Produced) -> None:
        """The trainer took ``produced``: the loader's position after its prompts is trained."""
        self.trained = produced.loader_state


class ProducerFailed(RuntimeError):
    """Generation ahead of training failed; the cause is chained."""


class Producer:
    """A thread calling ``make(step)`` for ``first .. last`` in order. Step ``t`` starts once the
    trainer has finished step ``t - 1 - max_staleness`` (:meth:`finished`), so its samples come
    from weights at most ``max_staleness`` versions old; with 0 every step is generated after the
    previous one ended, exactly as without the thread. ``take(t)`` waits for step ``t``. Under the
    exact schedule the trainer syncs version ``v`` only after :meth:`made` ``v + max_staleness``:
    step ``t`` then generates from exactly version ``t - 1 - max_staleness``.

    make: ``make(step, timer)`` builds a step's samples from the loader's next prompts, timing its
    stages on the producer's own ``timer`` (a ``StageTimer``); it must use the rollout only under
    the rollout's lock, which every ``RolloutGroup`` call takes.

    made: steps ``first, first + 1, ...`` made before a resume (a checkpoint kept them,
    :meth:`settled`), handed over first; the thread makes the steps after them."""

    def __init__(
        self, make: Callable[[int, StageTimer], Any], loader: Any, first: int, last: int, max_staleness: int, made: list[Produced] = ()
    ) -> None:
        if [p.step for p in made] != list(range(first, first + len(made))):
            raise ValueError(f"the steps made ahead before the resume, {[p.step for p in made]}, do not follow step {first - 1}")
        self.make, self.loader, self.timer = make, loader, StageTimer()
        self.first, self.last, self.max_staleness = first, last, max_staleness
        self.done_through = first - 1  # the last step the trainer finished
        self.made_through = first - 1 + len(made)  # the last step the producer made
        self.ready: dict[int, Produced] = {p.step: p for p in made}
        self.error: BaseException | None = None
        self.stopped = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="trellis-producer", daemon=True)

    def __enter__(self) -> Producer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop(self) -> None:
        try:
            for step in range(self.made_through + 1, self.last + 1):
                start = time.perf_counter()
                with self.cond:
                    self.cond.wait_for(lambda t=step: self.stopped or self.done_through >= t - 1 - self.max_staleness)
                    if self.stopped:
                        return
                waited = time.perf_counter() - start
                value = self.make(step, self.timer)
                produced = Produced(step, value, self.loader.state_dict(), self.timer.metrics(), waited)
                with self.cond:
                    self.ready[step] = produced
                    self.made_through = step
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread by take()
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def take(self, step: int) -> tuple[Produced, dict[str, float]]:
        """Step ``step``'s samples and the figures of the hand-over: ``async/buffered_steps`` (steps
        ready, this one included) and ``timing/wait_gen_s`` (how long the trainer waited)."""
        start = time.perf_counter()
        with self.cond:
            self.cond.wait_for(lambda: step in self.ready or self.error is not None)
            if step not in self.ready:
                raise ProducerFailed(f"generating the samples of step {step} ahead of training failed: {self.error!r}") from self.error
            buffered = len(self.ready)
            produced = self.ready.pop(step)
        return produced, {"async/buffered_steps": float(buffered), "timing/wait_gen_s": time.perf_counter() - start}

    def made(self, step: int) -> None:
        """Wait until step ``step`` (at most the last) was made, or the producer failed or stopped."""
        with self.cond:
            self.cond.wait_for(lambda: self.made_through >= min(step, self.last) or self.error is not None or self.stopped)

    def settled(self) -> list[Produced]:
        """Once the producer made every step the trainer's progress lets it (and waits for the
        trainer), the steps made and not taken, in order; the loader is then past their prompts.
        Under the exact schedule this is what a checkpoint keeps: their weights are gone by a resume.
        Called from the trainer's thread, the one that moves ``done_through``."""
        self.made(self.done_through + 1 + self.max_staleness)
        with self.cond:
            return [self.ready[step] for step in sorted(self.ready)]

    def finished(self, step: int) -> None:
        """The trainer finished ``step`` (update, weight sync, validation, checkpoint)."""
        with self.cond:
            self.done_through = step
            self.cond.notify_all()

    def close(self) -> None:
        """Stop after the step being generated (a generation is not interrupted) and wait for it."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join()


def staleness_metrics(versions: Any, step: int) -> dict[str, float]:
    """``rollout/staleness_mean|max``: how many weight versions the samples ``versions`` ``(batch,)``
    (their ``weight_version``) lag the weights step ``step`` starts from (``step - 1``)."""
    lag = (step - 1 - versions).float()
    return {"rollout/staleness_mean": float(lag.mean()), "rollout/staleness_max": float(lag.max())}
