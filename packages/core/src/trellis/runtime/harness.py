"""The run harness every recipe uses, by composition: threads and seeds, the controller and the
roles it spawns, checkpoint restore and save, trackers, lifecycle hooks, stage timers, clean-up.

A recipe's ``run`` reads as its loop::

    with Run(cfg, ctx) as run:
        if run.finished:
            return run.finished_summary()
        actor = run.spawn("actor", cfg.model.path, cfg.actor, objectives={"update": "policy"})
        rollout = run.spawn_rollout(actor, tokenizer)
        start = run.start(roles={"actor": actor}, state={"data": loader}, rollout=rollout, validate=held_out)
        for step in run.steps(start):
            with run.generating(rollout):
                batch = rollout.generate(loader.next_batch(), params)
            with run.timer("update"):
                metrics = actor.update(batch)
            rollout.sync_weights(version=step)
            run.end_step(step, metrics)
        return run.summary

The harness owns the choreography every generating recipe shares, so recipes cannot drift apart:
roles offloaded and engines awake while generating, engines asleep and roles back for training
(``generating``), the engines synced on resume, and validation before the first step, every
``trainer.val_every_steps`` and after the last (``start(validate=...)``), logged, in
``run.metrics`` and in ``run.summary``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from trellis.config import ConfigError, resolve_component, save
from trellis.interfaces.backend import DistInfo
from trellis.interfaces.dispatch import Mesh
from trellis.interfaces.rollout import RolloutSpec, engine_devices
from trellis.plugins import Plugins
from trellis.registry import Registry
from trellis.runtime import provenance
from trellis.runtime.checkpoint import Checkpointer
from trellis.runtime.controller import Controller, RolloutGroup, WorkerGroup
from trellis.runtime.signals import SignalWatch
from trellis.runtime.threads import Threads
from trellis.runtime.trackers import StepRows, Trackers
from trellis.runtime.worker import RoleWorker, WorkerSpec

log = logging.getLogger("trellis")


@dataclass
class RunContext:
    """What ``trellis train`` hands a recipe: the loaded plugins (registry and lifecycle hooks), the
    run folder, the checkpoint to resume from (found and checked before anything was built) and
    the composed config, written to the run folder once the run starts (``write_config``)."""

    plugins: Plugins
    run_dir: Path
    resume_from: Path | None = None
    config: DictConfig | None = None

    _written: bool = dataclasses.field(default=False, repr=False)

    def write_config(self) -> None:
        """Save ``config.yaml`` in the run folder, once: the first thing a run writes, so a run
        stopped earlier (by a data check, say) leaves no folder behind."""
        if self.config is not None and not self._written:
            save(self.config, self.run_dir / "config.yaml")
            provenance.write(self.run_dir)  # versions, CPU, torch threads: what the figures also depend on
            log.info("run folder: %s", self.run_dir)
            self._written = True

    @property
    def registry(self) -> Registry:
        return self.plugins.registry

    @property
    def hook(self):
        return self.plugins.hook


def controller_class(registry: Registry, trainer: DictConfig) -> type[Controller]:
    """The controller ``trainer.controller`` names (checked when the config was composed); a recipe
    whose trainer section has no such key runs locally."""
    return registry.get("controller", trainer.get("controller", "local")).obj


def make_threads(registry: Registry, trainer: DictConfig) -> Threads:
    """``trainer.threads`` for this process, the usable cores shared by the ranks this machine runs."""
    try:
        return Threads(trainer.threads, controller_class(registry, trainer).ranks(trainer)[1])
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def backend_mesh(cfg: DictConfig, registry: Registry) -> Mesh:
    """The mesh the run's backend lays its ranks out in (for checks made before anything is built)."""
    _, options = resolve_component(registry, "backend", cfg.backend)
    return Mesh.for_options(options, controller_class(registry, cfg.trainer).ranks(cfg.trainer)[0])


def policy_section(cfg: DictConfig, registry: Registry) -> DictConfig | None:
    """The config section the run's recipe builds its policy from (its ``policy``: ``actor`` for
    rl, ``train`` for sft and spin); None for a recipe that trains no policy."""
    section = registry.get("recipe", cfg.recipe).declared["policy"]
    return cfg.get(section) if section else None


def spawn_worker(
    controller: Controller,
    registry: Registry,
    cfg: DictConfig,
    role: str,
    model_path: str,
    role_options: Any,
    objectives: dict[str, str] | None = None,
    head: str = "lm",
) -> WorkerGroup:
    """``role`` on the controller's ranks: the backend ``cfg.backend`` names, laid out as its
    options' mesh, with ``head``, driven by the named objectives."""
    make_backend, options = resolve_component(registry, "backend", cfg.backend)
    mesh = Mesh.for_options(options, controller.world_size())
    total_steps = cfg.trainer.total_steps if "trainer" in cfg else 0
    spec = WorkerSpec(
        role,
        model_path,
        make_backend,
        options,
        role_options,
        dict(objectives or {}),
        registry=registry,
        seed=cfg.seed,
        total_steps=total_steps,
        head=head,
    )
    return controller.spawn(role, functools.partial(_role_worker, spec), mesh)


def _role_worker(spec: WorkerSpec, dist: DistInfo) -> RoleWorker:
    return RoleWorker(dataclasses.replace(spec, dist=dist))


class StageTimer:
    """``with timer("gen"):`` adds ``timing/gen_s``; ``timer.metrics()`` returns and resets them.
    With CUDA in use it also records, per stage, the peak memory torch allocated in this process
    (``memory/gen_peak_gib``) and the device memory in use at the stage's end by every allocator and
    process (``memory/gen_used_gib``: what an engine's own pools hold shows there)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"timing/{stage}_s"] = self.times.get(f"timing/{stage}_s", 0.0) + time.perf_counter() - start
            if cuda:
                free, total = torch.cuda.mem_get_info()
                peak = f"memory/{stage}_peak_gib"
                self.times[peak] = max(self.times.get(peak, 0.0), torch.cuda.max_memory_allocated() / 2**30)
                self.times[f"memory/{stage}_used_gib"] = (total - free) / 2**30

    def add(self, stage: str, seconds: float) -> None:
        """Add ``seconds`` to ``timing/<stage>_s`` (time measured elsewhere, e.g. on another thread)."""
        self.times[f"timing/{stage}_s"] = self.times.get(f"timing/{stage}_s", 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out


class Run:
    """One run of a recipe. Enter it to pin threads and seed torch; it makes the controller on
    the first spawn; ``start`` restores a checkpoint, opens the trackers and fires
    ``trellis_train_start``; ``end_step`` logs a step, fires ``trellis_step_end`` and saves when
    due; leaving it (also on an error) closes trackers and what :meth:`closing` was given, stops
    the controller and fires ``trellis_train_end``."""

    def __init__(self, cfg: DictConfig, ctx: RunContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.registry = ctx.registry
        self.checkpointer = Checkpointer(cfg, ctx.run_dir, ctx.resume_from, ctx.hook)
        self.timer = StageTimer()
        self.metrics: dict[str, float] = {}  # the last step's figures
        self._controller: Controller | None = None
        self._groups: list[WorkerGroup] = []
        self._trackers: Trackers | None = None
        self._samples: StepRows | None = None
        self._step_start = 0.0
        self.threads = make_threads(self.registry, cfg.trainer)
        self.summary: dict[str, Any] = {}  # what the recipe returns: val_before / val_after, ...
        self._validating_step = 0  # the step the validation running now belongs to
        self.signals = SignalWatch()
        self._rollout: RolloutGroup | None = None
        self._validate: Callable[[], dict[str, float]] | None = None
        self._overlap = False
        self._closing = contextlib.ExitStack()

    # -- set-up ------------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """The checkpoint to resume from is already at ``trainer.total_steps``: nothing to do."""
        return self.checkpointer.finished

    def finished_summary(self) -> dict[str, Any]:
        return {"finished_at_step": self.checkpointer.start_step}

    def __enter__(self) -> Run:
        if not self.finished:
            self.threads.start()
            torch.manual_seed(self.cfg.seed)
        return self

    @property
    def controller(self) -> Controller:
        if self._controller is None:
            self._controller = controller_class(self.registry, self.cfg.trainer).from_trainer(self.cfg.trainer)
        return self._controller

    def spawn(self, role: str, model_path: str, role_options: Any, *, head: str = "lm", objectives: dict[str, str] | None = None) -> WorkerGroup:
        """Any named role on every rank (see :func:`spawn_worker`): a model from ``model_path``
        with ``head`` (``lm``, ``value``), trained by ``objectives`` ({verb: objective}) if given."""
        group = spawn_worker(self.controller, self.registry, self.cfg, role, model_path, role_options, objectives, head)
        self._groups.append(group)
        return group

    def closing(self, thing: Any) -> Any:
        """``thing``, whose ``close()`` runs when the run ends, also on an error (the last given
        first, before the controller stops): what a recipe starts outside the controller."""
        self._closing.callback(thing.close)
        return thing

    def spawn_rollout(self, actor: WorkerGroup, tokenizer: Any, max_len: int = 0, own_weights: bool = False) -> RolloutGroup:
        """The engine ``cfg.rollout`` names, in the actor's processes, laid out as its options' mesh,
        or in ``trainer.rollout_pool`` processes of their own (a controller with engine pools: Ray), each spanning the engine's
        ``tensor_parallel_size`` devices; ``max_len``: the longest prompt + response the recipe
        asks for (the engine's context); ``own_weights``: the engine never generates from the
        actor's own model (see :meth:`Controller.spawn_rollout`)."""
        make_engine, options = resolve_component(self.registry, "rollout", self.cfg.rollout)
        adapter = (policy_section(self.cfg, self.registry) or {}).get("adapter") or {}
        spec = RolloutSpec(self.cfg.model.path, options, tokenizer, seed=self.cfg.seed, max_len=max_len, adapter_rank=adapter.get("rank", 0))
        mesh = Mesh.for_options(options, self.controller.world_size())
        make = functools.partial(make_engine, spec)
        return self.controller.spawn_rollout(make, actor, mesh, own_weights, engine_devices=engine_devices(options))

    def start(
        self,
        roles: dict[str, WorkerGroup | None],
        state: dict[str, Any],
        rollout: RolloutGroup | None = None,
        validate: Callable[[], dict[str, float]] | None = None,
        validate_before: bool = True,
        overlap: bool = False,
    ) -> int:
        """Load the checkpoint being resumed (roles' shards, stateful objects' ``state_dict``,
        RNG states) and remember what to save; open the trackers. Returns the step the run
        continues after (0 for a fresh run).

        rollout: the engines the recipe generates with: on resume they take the restored weights.
        validate: held-out figures ``{name: value}`` (generating on ``rollout``), run before the
            first step of a fresh run (``validate_before``), after every ``trainer.val_every_steps``
            and after the last step; logged as ``val/<name>`` and kept in :attr:`summary`
            (``val_before``, ``val_after``).
        overlap: generation overlaps training (``trainer.async_mode``): the engines stay awake
            and the roles on their devices, so :meth:`generating` moves no memory."""
        if validate is not None and rollout is None:
            raise ValueError("Run.start(validate=...) generates on the rollout: pass rollout= too")
        self.ctx.write_config()
        start = self.checkpointer.restore(roles, state)
        self._rollout, self._validate, self._overlap = rollout, validate, overlap
        if start and rollout is not None:
            rollout.sync_weights(version=start)
        trainer = self.cfg.trainer
        self._trackers = Trackers(trainer.trackers, self.registry, self.ctx.run_dir, trainer.total_steps, start_step=start)
        if trainer.get("log_samples"):
            self._samples = StepRows(self.ctx.run_dir / "samples.jsonl")
            self._samples.rewind(start)
        self.ctx.hook.trellis_train_start(config=self.cfg, run_dir=self.ctx.run_dir)
        if validate is not None and validate_before and not start and trainer.total_steps:  # else val_after alone
            self.summary["val_before"] = self._validation(0)
            self.log(0, _prefixed(self.summary["val_before"]))
        return start

    @contextlib.contextmanager
    def generating(self, rollout: RolloutGroup) -> Iterator[None]:
        """The engines generate inside the block: on entry every role offloads (optimizer state,
        parameters to host memory as its backend's options say) and engines a step left asleep
        (no weight sync since) wake; on exit the engines sleep (their memory goes to training
        until the next weight sync wakes them) and the roles onload. Nothing moves when generation
        overlaps training (``start(overlap=True)``): neither side can lend the other its memory."""
        if self._overlap:
            yield
            return
        for role in self._groups:
            role.offload()
        if rollout.asleep:
            rollout.wake()
        yield
        rollout.sleep()
        for role in self._groups:
            role.onload()

    def _validation(self, step: int) -> dict[str, float]:
        self._validating_step = step
        with self.generating(self._rollout):
            return self._validate()

    # -- the loop ----------------------------------------------------------------------------------
    def steps(self, start: int) -> Iterator[int]:
        """Steps ``start + 1 .. trainer.total_steps``, each timed from here to ``end_step``; after
        the last, the validation ``start`` was given (``val_after``, logged at the last step)."""
        total = self.cfg.trainer.total_steps
        for step in range(start + 1, total + 1):
            self._step_start = time.perf_counter()
            yield step
        if self._validate is not None:
            self.summary["val_after"] = self._validation(total)
            self.metrics.update(_prefixed(self.summary["val_after"]))
            self.log(total, _prefixed(self.summary["val_after"]))

    def due(self, step: int) -> bool:
        """Whether ``trainer.val_every_steps`` asks for a validation after ``step``."""
        every = self.cfg.trainer.val_every_steps
        return bool(every) and step % every == 0

    def end_step(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Validate when ``trainer.val_every_steps`` says so (not after the last step: the
        validation after training does); add the stage timings, dispatch cost and
        ``timing/step_s``; log; fire ``trellis_step_end``; checkpoint when due. Returns the
        logged metrics."""
        if self._validate is not None and self.due(step) and step < self.cfg.trainer.total_steps:
            with self.timer("val"):
                metrics = {**metrics, **_prefixed(self._validation(step))}
        metrics = {**metrics, **self.timer.metrics(), **self._dispatch_metrics()}
        metrics["timing/step_s"] = time.perf_counter() - self._step_start
        metrics["timing/threads"] = float(self.threads.check())
        self.metrics = metrics
        self.signals.check(step, metrics)
        self.log(step, metrics)
        self.ctx.hook.trellis_step_end(step=step, metrics=metrics)
        self.checkpointer.after_step(step)
        return metrics

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._trackers.log(step, metrics)

    def log_samples(self, step: int, batch: Any, scores: Any, tokenizer: Any, split: str = "train") -> None:
        """``trainer.log_samples`` samples of a generated batch, decoded, with their reward, as rows
        of ``<run_dir>/samples.jsonl`` (rewound with the metrics on resume), ``split`` ``train`` or
        ``val``: the first sample of each prompt in the batch's order, then the second of each...
        (so a step shows several prompts, not one prompt's group). A multi-turn sample adds
        ``conversation`` (every token after the prompt, the environment's turns included, special
        tokens kept so the turns show), ``num_turns``, ``turn_scores`` and ``finish_reason``."""
        if self._samples is None:
            return
        width = batch["prompts"].shape[1]
        rows = []
        for i in across_prompts(batch)[: self.cfg.trainer.log_samples]:
            prompt = batch["prompts"][i][batch["attention_mask"][i, :width].bool()]
            response = batch["responses"][i][batch["response_mask"][i].bool()]
            rows.append(
                {
                    "step": step,
                    "split": split,
                    "prompt": tokenizer.decode(prompt.tolist()),
                    "response": tokenizer.decode(response.tolist(), skip_special_tokens=True),
                    "reward": float(scores[i]),
                    "data_source": batch["data_source"][i],
                    "ground_truth": _plain(batch["ground_truth"][i]),
                }
            )
            if "num_turns" in batch:
                conversation = batch["responses"][i][batch["attention_mask"][i, width:].bool()]
                rows[-1].update(
                    {
                        "conversation": tokenizer.decode(conversation.tolist()),
                        "num_turns": int(batch["num_turns"][i]),
                        "turn_scores": [float(x) for x in batch["turn_scores"][i]],
                        "finish_reason": batch["finish_reason"][i],
                    }
                )
        self._samples.write(rows)

    def log_validation(self, batch: Any, scores: Any, tokenizer: Any) -> None:
        """The greedy generations of the validation running now, as :meth:`log_samples` rows with
        ``split`` ``val`` at its step (0 before training)."""
        self.log_samples(self._validating_step, batch, scores, tokenizer, split="val")

    def _dispatch_metrics(self) -> dict[str, float]:
        if self._controller is None:
            return {}
        out = {"timing/dispatch_s": self._controller.dispatch_seconds()}
        if any(g.ships for g in self._groups):
            sent, given = (sum(x) for x in zip(*(g.traffic() for g in self._groups)))
            out |= {"dispatch/sent_mb": sent / 2**20, "dispatch/batch_mb": given / 2**20}
        return out

    # -- the end -----------------------------------------------------------------------------------
    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None and self._trackers is not None:
            self.checkpointer.mark_finished()  # the recipe's end tasks ran inside the block
        try:
            if self._trackers is not None:
                self._trackers.close()
            if self._samples is not None:
                self._samples.close()
        finally:
            try:
                self._closing.close()
            finally:
                if self._controller is not None:
                    self._controller.shutdown()
            if self._trackers is not None:
                self.ctx.hook.trellis_train_end(run_dir=self.ctx.run_dir, metrics=self.metrics)


def across_prompts(batch: Any) -> list[int]:
    """The batch's sample indices, the first sample of each prompt (``uid``) in order, then the
    second of each, and so on."""
    groups = batch.group_index("uid").tolist() if "uid" in batch else list(range(len(batch)))
    seen = [0] * (max(groups, default=-1) + 1)
    rank = []
    for g in groups:
        rank.append(seen[g])
        seen[g] += 1
    return sorted(range(len(groups)), key=lambda i: (rank[i], i))


def _prefixed(figures: dict[str, float]) -> dict[str, float]:
    return {f"val/{k}": v for k, v in figures.items()}


def _plain(value: Any) -> Any:
    """A ground truth as JSON can hold it (numpy arrays from parquet become lists)."""
    return value.tolist() if hasattr(value, "tolist") else value
