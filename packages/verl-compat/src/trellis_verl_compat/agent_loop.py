"""The agent loop ``verl``: a user's verl 0.9 ``AgentLoopBase`` subclass run unchanged, built per
sample as verl builds it, its ``server_manager.generate`` served by the trellis engine and its
``AgentLoopOutput`` turned into a ``Trajectory``. verl itself must be installed (``--no-deps``
suffices; the README lists what importing its agent loop module needs)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import importlib.resources
import json
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, OmegaConf

from trellis import AgentLoop, Generation, SamplingParams, Trajectory

# verl's sampling keys that the trellis engine decides: a loop may repeat the run's values, never change them
RUN_SAMPLING = ("temperature", "top_p", "top_k")


@dataclass
class VerlAgentLoopOptions:
    """verl_class: ``package.module.Class``, a subclass of verl's ``AgentLoopBase`` (verl's
    ``_target_``). kwargs: more keyword arguments for its constructor (the other keys of verl's
    ``agent_loop_config_path`` entry). config: keys merged over the trainer config the loop reads
    as ``self.config`` (verl's own defaults, then what trellis sets: ``actor_rollout_ref.rollout``'s
    lengths, sampling and ``multi_turn`` limits)."""

    verl_class: str = MISSING
    kwargs: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cls = load_verl_loop(self.verl_class)


def load_verl_loop(path: str) -> type:
    """The ``AgentLoopBase`` subclass ``package.module.Class`` names (importing its module runs its
    ``@register``); errors say what is wrong and what to give."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"verl_class is {path!r}; give a class path such as my_package.my_loops.MyAgentLoop")
    try:
        base = importlib.import_module("verl.experimental.agent_loop").AgentLoopBase
    except ImportError as exc:
        raise ValueError(
            f"verl_class {path!r} needs verl's agent loop module, which does not import ({exc}); install verl and what it imports "
            "as trellis-interactions' README says"
        ) from None
    try:
        cls = getattr(importlib.import_module(module_name), name, None)
    except ImportError as exc:
        raise ValueError(f"verl_class: cannot import module {module_name!r} ({exc}); is its package installed?") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"verl_class {path!r} is not a subclass of verl.experimental.agent_loop.AgentLoopBase (got {cls!r})")
    return cls


class VerlAgentLoop(AgentLoop):
    """Each sample: the verl class built with verl's constructor arguments, ``run(sampling_params,
    **row)`` awaited with the row's columns that trellis's data keeps (``raw_prompt``,
    ``data_source``, ``reward_model`` with its ``ground_truth``, ``ability``, ``extra_info``...) plus
    ``tools_kwargs``, ``interaction_kwargs`` and ``index`` from ``extra_info``, as verl calls it;
    its output checked (its prompt is the row's prompt as trellis rendered it; every model turn was
    sampled after the very ids the trajectory holds before it) and returned as the sample's
    ``Trajectory``."""

    def __init__(self, engine: Any, spec: Any, env: Any, options: VerlAgentLoopOptions) -> None:
        super().__init__(engine, spec, env)
        self.options = options
        # the verl class objects of multi_turn.tools (verl_class entries), handed over as verl hands its tools
        self.verl_tools = [make().inner for make, tcfg in spec.tools if tcfg.verl_class]
        self.model_type = model_type(self.tokenizer)
        self.config_overrides = OmegaConf.to_container(OmegaConf.create(options.config))  # options.config as plain data, once

    row_fields = True  # verl calls a loop's run with every column of the row

    async def sample(
        self, prompt_ids: list[int], raw_prompt: list[dict], extra_info: dict, params: SamplingParams, fields: dict[str, Any]
    ) -> Trajectory:
        from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
        from verl.utils.dataset.rl_dataset import RLHFDataset

        config = self.trainer_config(prompt_ids, params)
        sampling = {
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "repetition_penalty": 1.0,
            "logprobs": True,
        }
        server = ServerManager(self.engine, params, sampling)
        loop = self.options.cls(
            trainer_config=DictConfigWrap(config),
            server_manager=server,
            tokenizer=self.tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(config.data),
            hf_model_type=self.model_type,
            tools=ToolListWrap(self.verl_tools),
            **self.options.kwargs,
        )
        loop.loop = HelperLoop(loop.loop)
        # every column of the row, as verl passes them, and the fields verl's dataset adds from extra_info
        row = {
            **fields,
            "reward_model": fields.get("reward_model") or {"ground_truth": fields.get("ground_truth")},
            "raw_prompt": raw_prompt,
            "extra_info": extra_info,
            "tools_kwargs": extra_info.get("tools_kwargs", {}),
            "interaction_kwargs": extra_info.get("interaction_kwargs", {}),
            "index": extra_info.get("index", 0),
        }
        output = await loop.run(sampling, **row)
        return trajectory(output, prompt_ids, server.calls, type(loop).__name__)

    def trainer_config(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        """verl's generated PPO config with this run's limits, then ``options.config`` over it."""
        s = self.settings
        budget = s.response_budget(params.max_new_tokens)
        rollout = {
            # a cap on the loop's own rendering of the prompt, which must be trellis's: verl's is data.max_prompt_length
            "prompt_length": self.spec.max_prompt_length or len(prompt_ids),
            "response_length": budget,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "calculate_log_probs": True,
            "multi_turn": {
                "enable": True,
                "max_assistant_turns": s.max_assistant_turns,
                "max_user_turns": s.max_user_turns,
                "max_tool_response_length": s.max_tool_response_chars,
                "format": s.tool_parser,
            },
        }
        data = {"apply_chat_template_kwargs": {k: v for k, v in self.spec.template_kwargs.items() if k != "tools"}}
        overrides = {"actor_rollout_ref": {"rollout": rollout}, "data": data}
        return verl_config(json.dumps([overrides, self.config_overrides], sort_keys=True))


@functools.cache
def verl_defaults() -> Any:
    """verl's generated PPO config (``_generated_ppo_trainer.yaml``), read once (merges copy it, never change it)."""
    return OmegaConf.load(str(importlib.resources.files("verl") / "trainer" / "config" / "_generated_ppo_trainer.yaml"))


@functools.lru_cache(maxsize=64)
def verl_config(overrides: str) -> Any:
    """:func:`verl_defaults` with ``overrides`` (a JSON list of mappings) merged over it, resolved and
    read-only (every sample of every rollout with these limits shares it: a loop that writes to it is
    refused). Built once per set of limits: loading and resolving verl's ~900 keys costs ~0.4 s, which
    per sample held the event loop every sample shares."""
    merged = OmegaConf.merge(verl_defaults(), *json.loads(overrides))
    OmegaConf.resolve(merged)
    OmegaConf.set_readonly(merged, True)
    return merged


class HelperLoop:
    """The event loop as a verl loop holds it (``self.loop``), with verl's own helpers run inline.

    verl's loops hand their tokenising (``ct_build_initial_tokens``, ``ct_merge_*``) to the default
    executor: three thread hops a turn, each waiting for the interpreter lock the engine's thread
    holds, which made a verl loop about half as fast as trellis's own on the same tokens
    (``bench/multiturn.py``, verl-loop). A function of verl's own modules runs inline on the event
    loop, as trellis's loop tokenises; anything else (a user's blocking call) still goes to the executor."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def run_in_executor(self, executor: Any, fn: Any, *args: Any) -> asyncio.Future:
        if executor is not None or not getattr(fn, "__module__", "").startswith("verl."):
            return self._loop.run_in_executor(executor, fn, *args)
        future = self._loop.create_future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - raised where the loop awaits it, as from the executor
            future.set_exception(exc)
        return future

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


class ServerManager:
    """verl's ``LLMServerClient.generate`` onto the trellis engine: one turn sampled after
    ``prompt_ids`` with the sample's settings, returned as verl's ``TokenOutput``; every call kept
    (``calls``: prompt ids and generation) for the trajectory's check."""

    def __init__(self, engine: Any, params: SamplingParams, sampling: dict[str, Any]) -> None:
        self.engine = engine
        self.params = params
        self.sampling = sampling
        self.calls: list[tuple[list[int], Generation]] = []

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        **kwargs: Any,
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data or audio_data:
            raise ValueError("verl agent loop: image, video and audio inputs are not supported by trellis's engines; send text prompts")
        params = self.turn_params(sampling_params)
        gen = await self.engine.agenerate(list(prompt_ids), params)
        self.calls.append((list(prompt_ids), gen))
        return TokenOutput(token_ids=list(gen.token_ids), log_probs=list(gen.log_probs), stop_reason="completed")

    def turn_params(self, given: dict[str, Any]) -> SamplingParams:
        """The sample's params for one turn: ``max_tokens`` / ``max_new_tokens`` may shorten the turn,
        ``stop_token_ids`` add stops; temperature, top_p and top_k must be the run's (the trainer
        scores every token at them), repetition_penalty 1."""
        for key in RUN_SAMPLING:
            if key in given and given[key] != self.sampling[key]:
                raise ValueError(
                    f"verl agent loop: sampling_params[{key!r}] is {given[key]!r}, but the run samples with {self.sampling[key]!r} "
                    "and the trainer scores every token at it; pass the sampling_params run() got"
                )
        if given.get("repetition_penalty", 1.0) != 1.0:
            raise ValueError(f"verl agent loop: sampling_params['repetition_penalty'] is {given['repetition_penalty']!r}; trellis samples with 1.0")
        room = min(int(given.get(k, self.params.max_new_tokens)) for k in ("max_tokens", "max_new_tokens"))
        stops = [*self.params.stop_token_ids, *(given.get("stop_token_ids") or [])]
        return dataclasses.replace(self.params, max_new_tokens=min(self.params.max_new_tokens, room), stop_token_ids=stops)


def trajectory(output: Any, prompt_ids: list[int], calls: list[tuple[list[int], Generation]], loop: str) -> Trajectory:
    """``AgentLoopOutput`` as a ``Trajectory``: its response ids, mask and log-probs (the engine's,
    where the loop returned none), ``reward_score`` as the loop's reward (the sample's whole reward
    when given, as in verl), ``extra_fields``'
    ``turn_scores`` and ``tool_rewards``. Raises ValueError when its prompt is not ``prompt_ids``
    or a turn was sampled after ids other than the trajectory's."""
    if list(output.prompt_ids) != prompt_ids:
        at = next((i for i, (a, b) in enumerate(zip(output.prompt_ids, prompt_ids)) if a != b), min(len(output.prompt_ids), len(prompt_ids)))
        raise ValueError(
            f"verl agent loop {loop!r} returned prompt_ids of {len(output.prompt_ids)} tokens that differ from the row's prompt as "
            f"trellis rendered it ({len(prompt_ids)} tokens) from position {at}; render raw_prompt with the tokenizer's chat "
            "template and the data's apply_chat_template_kwargs (and multi_turn.tools as tools), as verl's loops do"
        )
    ids, mask = list(output.response_ids), list(output.response_mask)
    full = prompt_ids + ids
    for turn, (context, _) in enumerate(calls):
        if len(context) <= len(full) and full[: len(context)] != context:
            raise ValueError(
                f"verl agent loop {loop!r}: model turn {turn + 1} was sampled after ids that are not the trajectory's up to there; "
                "keep every turn's token ids as generate returned them and append the environment's after them"
            )
    log_probs = list(output.response_logprobs) if output.response_logprobs else sampled_log_probs(ids, mask, calls)
    extra = output.extra_fields or {}
    assistant = len(calls)
    return Trajectory(
        response_ids=ids,
        response_mask=mask,
        log_probs=log_probs,
        turn_scores=[float(x) for x in extra.get("turn_scores") or []],
        tool_reward=float(sum(extra.get("tool_rewards") or [])),
        agent_reward=float(output.reward_score or 0.0),
        agent_scored=output.reward_score is not None,  # verl: the loop's score, else the reward function's
        assistant_turns=assistant,
        user_turns=max(int(output.num_turns) - assistant - 1, 0),  # verl counts the prompt, every user/tool turn and every model turn
        finish=calls[-1][1].finish_reason if calls else "done",
    )


def sampled_log_probs(ids: list[int], mask: list[int], calls: list[tuple[list[int], Generation]]) -> list[float]:
    """The engine's log-probs on the trained tokens, for a loop that returned none: the sampled
    tokens in order, matched id by id (a token matched by none keeps 0, which the sampled check refuses)."""
    stream = [(i, lp) for _, gen in calls for i, lp in zip(gen.token_ids, gen.log_probs)]
    out, at = [], 0
    for token, m in zip(ids, mask):
        if m and at < len(stream) and stream[at][0] == token:
            out.append(stream[at][1])
            at += 1
        else:
            out.append(0.0)
    return out


def model_type(tokenizer: Any) -> str | None:
    """The Hugging Face ``model_type`` of the tokenizer's model folder (verl picks its token builder
    by it), None where the folder has no model config."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(tokenizer.name_or_path).model_type
    except (OSError, ValueError):
        return None
