"""The rollout function of multi-turn runs: each prompt's samples run through the agent loop its
row picks (``agent_name`` column, else ``multi_turn.agent_loop``), next to an engine, many at once."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import OmegaConf

from trellis import (
    IMAGE_INPUTS,
    AgentLoop,
    Batch,
    ConfigError,
    Registry,
    RegistryError,
    RolloutEngine,
    SamplingParams,
    Scorer,
    Trajectory,
    instantiate_options,
    rollout_batch,
    validate,
)
from trellis.kit.multiturn import MODEL_INPUTS, PROMPT_IMAGES, ROUTED_EXPERTS, batch_routes, conversation_routes, join_images, pad_id
from trellis_multiturn.environment import AgentSpec, Environment
from trellis_multiturn.sampled import RecordingEngine, check_sampled, recording
from trellis_multiturn.scoring import ConversationScorer

AGENT_COLUMN = "agent_name"  # verl's column: the agent loop of a row


@dataclass
class AgentRollout:
    """``RolloutGroup.rollout``'s function for conversations (picklable: factories and classes).

    spec: the resolved ``multi_turn`` section. loops: the agent loop classes the data uses, by
    name (``spec.settings.agent_loop`` among them), from :func:`agent_rollout`. options: the
    checked options of the ``multi_turn.agent_loops`` among them, by name (built as
    ``cls(engine, spec, env, options)``).
    """

    spec: AgentSpec
    loops: dict[str, type[AgentLoop]]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def inputs(self) -> tuple[str, ...] | None:
        """The prompt fields the engines get: the token ids, chat messages, ``extra_info`` and
        ``agent_name``, or every field (None) when a loop takes the row's other columns."""
        if any(cls.row_fields for cls in self.loops.values()):
            return None
        return (*MODEL_INPUTS, IMAGE_INPUTS, "raw_prompt", "extra_info", AGENT_COLUMN)

    def scorer(self, reward_fn: Scorer, max_error_rate: float) -> ConversationScorer:
        """The reward of whole conversations (``multi_turn.score``)."""
        return ConversationScorer(self.spec.settings, reward_fn, max_error_rate)

    async def __call__(self, engine: RolloutEngine, prompts: Batch, params: SamplingParams) -> Batch:
        """``params.n`` conversations per prompt, every loop's samples in flight together (up to
        ``max_concurrent_samples``); the ``rollout_batch`` layout (response attention 1 on every
        token, ``response_mask`` 1 on the model's) plus per-sample ``num_turns``, ``user_turns``,
        ``tool_calls``, ``tool_errors``, ``malformed_calls``, ``tool_rewards``, ``agent_rewards``, ``agent_scored``, ``env_errors``, and
        ``turn_scores``, ``interaction``, ``finish_reason``, ``agent_name`` (Python fields).

        prompts: left-padded ``input_ids`` / ``attention_mask`` ``(batch, prompt_len)`` with
        ``raw_prompt`` (chat messages), ``extra_info`` and, if the data has it, ``agent_name`` per
        prompt."""
        env = Environment(self.spec)
        recorded = RecordingEngine(engine)
        built = {name: self.build(name, recorded, env) for name in self.loops}
        names = self.loop_names(prompts)
        limit = asyncio.Semaphore(self.spec.settings.max_concurrent_samples)

        async def one(name: str, *args: Any, fields: dict[str, Any], images: dict) -> Trajectory:
            async with limit:
                turns = recording()  # this sample's task's own record
                loop = self.loops[name]
                extra = {**({"fields": fields} if loop.row_fields else {}), **({"images": images} if loop.takes_images else {})}
                traj = await built[name].sample(*args, **extra)
                check_sampled(traj, turns, name, self.spec.tokenizer)
                traj.routed_experts = conversation_routes(args[0] + traj.response_ids, turns)
                return traj

        images = list(prompts[IMAGE_INPUTS]) if IMAGE_INPUTS in prompts else [{}] * len(prompts)  # loops that take none refused at build
        jobs = []
        for i in range(len(prompts)):
            ids = prompts["input_ids"][i][prompts["attention_mask"][i].bool()].tolist()
            for j in range(params.n):
                single = dataclasses.replace(params, n=1, seed=params.sample_seed(i * params.n + j))
                args = (ids, prompts["raw_prompt"][i], prompts["extra_info"][i] or {}, single)
                jobs.append(one(names[i], *args, fields=row_fields(prompts, i), images=images[i]))
        try:
            trajectories = await asyncio.gather(*jobs)
        finally:
            for loop in built.values():
                await loop.close()
        out = assemble(prompts, params, trajectories, pad_id(self.spec.tokenizer))
        out[AGENT_COLUMN] = [name for name in names for _ in range(params.n)]
        return out

    def build(self, name: str, engine: RolloutEngine, env: Environment) -> AgentLoop:
        """Loop ``name`` for one rollout call, with its options where ``multi_turn.agent_loops`` gives them."""
        if name in self.options:
            return self.loops[name](engine, self.spec, env, self.options[name])
        return self.loops[name](engine, self.spec, env)

    def loop_names(self, prompts: Batch) -> list[str]:
        """Each prompt's loop: its ``agent_name``, or ``multi_turn.agent_loop`` where it has none."""
        given = prompts[AGENT_COLUMN] if AGENT_COLUMN in prompts else [None] * len(prompts)
        return [self.spec.settings.agent_loop if name is None else name for name in given]


def row_fields(prompts: Batch, i: int) -> dict[str, Any]:
    """Prompt ``i``'s columns besides those every loop gets (its messages, ``extra_info``, ``agent_name``):
    the batch's fields of the row, and the row's other columns as the data file had them (``columns``)."""
    fields = {k: v[i] for k, v in prompts.non_tensors.items() if k not in ("raw_prompt", "extra_info", AGENT_COLUMN)}
    return {**(fields.pop("columns", None) or {}), **fields}


def agent_rollout(spec: AgentSpec, registry: Registry, data: Mapping[str, Iterable[tuple[int, Any]]] | None = None) -> AgentRollout:
    """The rollout function for ``data``'s rows: per data file (named as in errors, e.g.
    ``data.train_path 'x.parquet'``), each row's ``(row number, agent_name)``. Every name, and
    ``multi_turn.agent_loop``, must be an installed agent loop or one of ``multi_turn.agent_loops``;
    the error names the row, the name and the loops there are (checked before any model is built).
    With image prompts (``spec.images``) every loop used must take them."""
    default = spec.settings.agent_loop
    try:
        used = {default: registry.get("agent_loop", default).obj}
    except RegistryError as exc:
        raise ConfigError(f"config key 'multi_turn.agent_loop': {exc}") from None
    configured = configured_loops(spec, registry)
    with_options = [n for n in registry.names("agent_loop") if registry.get("agent_loop", n).options is not None]
    if default in with_options:
        raise ConfigError(f"config key 'multi_turn.agent_loop': {needs_entry(default)}")
    installed = [*(n for n in registry.names("agent_loop") if n not in with_options), *configured]
    for where, rows in (data or {}).items():
        for i, name in rows:
            if name is None or name in used:
                continue
            if name in with_options:
                raise ConfigError(f"{where}: row {i} has {AGENT_COLUMN}={name!r}: {needs_entry(name)}")
            if name not in installed:
                raise ConfigError(
                    f"{where}: row {i} has {AGENT_COLUMN}={name!r}, which is not an installed agent loop (installed: "
                    f"{', '.join(installed)}); install the plugin that registers it, or name one of these (rows without "
                    f"{AGENT_COLUMN} use multi_turn.agent_loop={default!r})"
                )
            used[name] = configured[name][0] if name in configured else registry.get("agent_loop", name).obj
    blind = [name for name, loop in used.items() if not loop.takes_images]
    if spec.images is not None and blind:
        raise ConfigError(
            f"config key 'multi_turn.agent_loop': agent loop {blind[0]!r} takes no images (AgentLoop.takes_images), and the prompts of "
            "a vision-language model have them; use tool_agent (the default)"
        )
    return AgentRollout(spec, used, {name: configured[name][1] for name in used if name in configured})


def needs_entry(name: str) -> str:
    return (
        f"agent loop {name!r} runs only with options; add an entry to multi_turn.agent_loops "
        f"({{name: my_loop, component: {name}, options: {{...}}}}) and name that entry in {AGENT_COLUMN}"
    )


def configured_loops(spec: AgentSpec, registry: Registry) -> dict[str, tuple[type[AgentLoop], Any]]:
    """``multi_turn.agent_loops`` by name: each component's class and its checked options (errors
    name the entry's key: a name taken, a component not installed, options it refuses)."""
    out: dict[str, tuple[type[AgentLoop], Any]] = {}
    for i, entry in enumerate(spec.settings.agent_loops):
        key = f"multi_turn.agent_loops[{i}]"
        if entry.name in out or entry.name in registry.names("agent_loop"):
            raise ConfigError(
                f"config key '{key}.name' is {entry.name!r}, which names another agent loop already (installed: "
                f"{', '.join(registry.names('agent_loop'))}; configured: {', '.join(out) or 'none'}); give it a name of its own"
            )
        try:
            found = registry.get("agent_loop", entry.component)
        except RegistryError as exc:
            raise ConfigError(f"config key '{key}.component': {exc}") from None
        if found.options is None:
            raise ConfigError(
                f"config key '{key}.component' is {entry.component!r}, which takes no options; rows name it in {AGENT_COLUMN} "
                "as it is, so drop this entry"
            )
        checked = validate(OmegaConf.create(dict(entry.options)), found.options, registry, f"{key}.options.")
        try:
            out[entry.name] = (found.obj, instantiate_options(checked, found.options))
        except (ValueError, TypeError) as exc:  # the options dataclass's own checks (e.g. a class that does not import)
            raise ConfigError(f"config key '{key}.options': {exc}") from None
    return out


def assemble(prompts: Batch, params: SamplingParams, trajectories: list[Trajectory], pad_id: int) -> Batch:
    """The ``rollout_batch`` layout from ``trajectories`` (prompt i's at rows i*n .. i*n+n-1)."""
    width = max((len(t.response_ids) for t in trajectories), default=0)
    n = len(trajectories)
    responses = torch.full((n, width), pad_id, dtype=prompts["input_ids"].dtype)
    mask = torch.zeros(n, width, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    log_probs = torch.zeros(n, width, dtype=torch.float32)
    for i, t in enumerate(trajectories):
        length = len(t.response_ids)
        responses[i, :length] = torch.tensor(t.response_ids, dtype=responses.dtype)
        mask[i, :length] = torch.tensor(t.response_mask)
        attention[i, :length] = 1
        log_probs[i, :length] = torch.tensor(t.log_probs, dtype=torch.float32)
    out = rollout_batch(prompts, params, responses, mask, log_probs, response_attention=attention)
    if any(t.routed_experts is not None for t in trajectories):
        lengths = prompts["attention_mask"].sum(-1).repeat_interleave(params.n).tolist()
        out[ROUTED_EXPERTS] = batch_routes([t.routed_experts for t in trajectories], lengths, prompts["input_ids"].shape[1], width)
    if any(t.image_inputs for t in trajectories):  # each sample's images: its prompt's, then those its tools returned
        shown = list(out.get(IMAGE_INPUTS, [{}] * n))
        out[IMAGE_INPUTS] = [join_images(images, t.image_inputs) for images, t in zip(shown, trajectories)]
        out[PROMPT_IMAGES] = [len(images["image_grid_thw"]) if images else 0 for images in shown]

    def counts(attr: str) -> torch.Tensor:
        return torch.tensor([getattr(t, attr) for t in trajectories], dtype=torch.long)

    out["num_turns"] = counts("assistant_turns")
    for key in ("user_turns", "tool_calls", "tool_errors", "malformed_calls"):
        out[key] = counts(key)
    out["env_errors"] = torch.tensor([t.finish == "error" for t in trajectories], dtype=torch.long)
    out["tool_rewards"] = torch.tensor([t.tool_reward for t in trajectories], dtype=torch.float32)
    out["agent_rewards"] = torch.tensor([t.agent_reward for t in trajectories], dtype=torch.float32)
    out["agent_scored"] = torch.tensor([t.agent_scored for t in trajectories], dtype=torch.bool)
    out["turn_scores"] = [list(t.turn_scores) for t in trajectories]
    out["interaction"] = [t.interaction for t in trajectories]
    out["finish_reason"] = [t.finish for t in trajectories]
    return out
