"""Interface of a rollout engine (kind ``rollout``): generation, weight updates, sleep/wake, close;
and what every engine shares (stop tokens, the right-padded sample layout, the sync order)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from trellis.batch import Batch, position_ids
from trellis.interfaces.backend import MODEL_INPUTS

log = logging.getLogger("trellis")

WEIGHTS, KV_CACHE = "weights", "kv_cache"  # what ``wake(tags)`` brings back (vLLM's and SGLang's tag names)
ALL_MEMORY = (WEIGHTS, KV_CACHE)
_said_once: set[str] = set()


def log_once(key: str, message: str, *args: Any) -> None:
    """A warning said once per process (per ``key``)."""
    if key not in _said_once:
        _said_once.add(key)
        log.warning(message, *args)


def sleep_skipped(engine: str, why: str) -> None:
    """Say once that ``engine`` keeps its memory through sleep/wake, and why (e.g. ``on CPU (...)``)."""
    log_once(f"sleep:{engine}", "rollout %r: sleep/wake is unsupported %s; skipped, the engine keeps its memory", engine, why)


def stop_ids(model_path: str | Path, tokenizer, hf_config=None) -> set[int]:
    """The model's end-of-sequence ids (its ``generation_config.json``, else its config) plus the
    tokenizer's EOS, and a vision-language model's image and video placeholders and the token that
    opens an image: generation stops at any of them. (A placeholder is an image's slot to the
    model; one sampled mid-response would have the trainer's forward look for an image there.
    Ending the response at it keeps every trained position's log-prob exact, and since a sampled
    image opening ends a turn too, a sampled placeholder never follows one, as each image an
    environment turn renders does: see :func:`trellis.interfaces.hf.image_kwargs`.)"""
    from transformers import AutoConfig, GenerationConfig

    config = hf_config or AutoConfig.from_pretrained(model_path)
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    opening = getattr(config, "vision_start_token_id", None)
    return ids | set(placeholder_ids(config)) | ({opening} if opening is not None else set())


def placeholder_ids(config) -> list[int]:
    """The image and video placeholder token ids of a vision-language model's config (none for a text model)."""
    return [t for t in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)) if t is not None]


def with_images(images: dict | None) -> dict:
    """``agenerate``'s keyword for a prompt's images, none without them (engines that take no
    images need not accept the keyword)."""
    return {"images": images} if images else {}


def pad_id(tokenizer) -> int:
    """The id responses are right-padded with: the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


@dataclass
class SamplingParams:
    """n samples per prompt; temperature 0 (or ``greedy``) means argmax decoding.
    return_routed_experts: a mixture-of-experts model's experts per token come back in the batch
    field ``routed_experts`` (:data:`trellis.interfaces.moe.ROUTED_EXPERTS`; an engine that cannot
    record them leaves it out)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    greedy: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    return_routed_experts: bool = False

    def at_step(self, step: int, samples_per_step: int) -> SamplingParams:
        """These params for trainer step ``step`` (1-based). Per-request seeds are opt-in: with a
        ``seed``, it moves on by the step's samples, so that with each engine seeding a sample
        with :meth:`sample_seed` every sample of a run gets a seed of its own."""
        return self.skip((step - 1) * samples_per_step)

    def skip(self, samples: int) -> SamplingParams:
        """These params for the samples after the first ``samples`` (a later step, or a later
        engine's chunk of the prompts): the seed moves on by ``samples``; None stays None."""
        return self if self.seed is None else dataclasses.replace(self, seed=self.seed + samples)

    def sample_seed(self, sample: int) -> int | None:
        """The seed of sample ``sample`` of a call (prompt ``i``'s ``j``-th sample is ``i * n + j``):
        ``seed + sample``, or None without a seed."""
        return None if self.seed is None else self.seed + sample


@dataclass
class Routes:
    """The experts a mixture-of-experts model routed the tokens of one ``agenerate`` call to:
    ``input_ids``, the call's prompt and sampled tokens but the last (which no forward ran), and
    ``experts`` ``(len(input_ids), moe_layers, top_k)`` int16."""

    input_ids: list[int]
    experts: torch.Tensor


@dataclass
class Generation:
    """One sample from ``agenerate``: token ids, their log-probs and why it stopped; ``routes`` with
    ``SamplingParams.return_routed_experts`` from an engine that records them."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    routes: Routes | None = None


def engine_devices(options: Any) -> int:
    """The devices one engine spans: its options' ``tensor_parallel_size`` (vLLM's, SGLang's), 1
    for an engine whose options have no such field."""
    return getattr(options, "tensor_parallel_size", 1)


class RolloutFn(Protocol):
    """A rollout of a kind of its own, run by ``RolloutGroup.rollout`` next to each engine on its
    share of the prompts (trellis-multiturn's ``AgentRollout``, the conversations of the rl recipe's ``multi_turn`` runs).
    It must pickle: the Ray controller sends it to every rank.

    inputs: the prompt fields it reads (e.g. ``MODEL_INPUTS`` plus ``raw_prompt``); the other
        fields stay with the caller and are repeated onto each prompt's samples.
    ``__call__(engine, prompts, params)``: ``params.n`` samples per prompt in the ``rollout_batch``
        layout (prompt i's at rows i*n .. i*n+n-1), or an awaitable of them; an async function runs
        on the engine's event loop, where ``engine.agenerate`` may be awaited.
    """

    inputs: tuple[str, ...]

    def __call__(self, engine: RolloutEngine, prompts: Batch, params: SamplingParams) -> Batch | Awaitable[Batch]: ...


@dataclass
class RolloutSpec:
    """What a rollout engine is built from: the model folder, its options and the tokenizer.
    max_len: the longest prompt + response the recipe will ask for (0: unknown); an engine sizes
    its context (vLLM ``max_model_len``, SGLang ``context_length``) from it unless its options say.
    adapter_rank: the policy trains a LoRA adapter of this rank (0: full weights); an engine that
    can sample with an adapter on its base weights prepares for it (``adapter_sync``)."""

    model_path: str
    options: Any
    tokenizer: Any
    seed: int = 0
    max_len: int = 0
    adapter_rank: int = 0


def engine_dtype(option: str | None, on_gpu: bool) -> str:
    """An engine's ``dtype`` option with its default filled in: None is ``bfloat16`` on a GPU (the
    colocated trainer computes in bf16 there and the KV cache halves) and ``float32`` on CPU."""
    if option is not None:
        return option
    return "bfloat16" if on_gpu else "float32"


def option_dtype(name: str) -> torch.dtype | None:
    """An engine's ``dtype`` option as a torch dtype (``bfloat16`` -> ``torch.bfloat16``); None for ``auto``."""
    return None if name == "auto" else getattr(torch, name)


def context_length(spec: RolloutSpec, option: int, hf_config) -> int:
    """The engine's context length: its own option if set, else the recipe's ``max_len`` (capped at
    the model's ``max_position_embeddings``); 0 leaves the engine's default (the model's maximum)."""
    if option or not spec.max_len:
        return option
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    longest = getattr(text, "max_position_embeddings", None)
    return min(spec.max_len, longest) if longest else spec.max_len


def rollout_batch(
    prompts: Batch,
    params: SamplingParams,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
    response_attention: torch.Tensor | None = None,
) -> Batch:
    """The layout every engine returns, from its sampled tokens.

    prompts: the ``generate`` input (``B`` left-padded prompts). responses, response_mask,
    log_probs: ``(B*n, response_len)``, right-padded, prompt i's samples at rows i*n .. i*n+n-1.
    Returns ``prompts.repeat_interleave(n)`` plus ``prompts``, ``responses``, ``response_mask``,
    ``rollout_log_probs`` (zero where masked) and ``input_ids`` / ``attention_mask`` /
    ``position_ids`` over prompt + response; ``meta["temperature"]`` is the one the log-probs use.
    response_attention: which response tokens exist ``(B*n, response_len)``; default
    ``response_mask``. Multi-turn rollouts pass 1 on environment tokens too, whose mask is 0.
    """
    out = prompts.repeat_interleave(params.n)
    response_mask = response_mask.to(out["attention_mask"].dtype)
    attend = response_mask if response_attention is None else response_attention.to(response_mask.dtype)
    attention_mask = torch.cat([out["attention_mask"], attend], dim=1)
    out.update(
        Batch(
            {
                "prompts": out["input_ids"],
                "responses": responses,
                "response_mask": response_mask,
                "rollout_log_probs": log_probs * response_mask,
                "input_ids": torch.cat([out["input_ids"], responses], dim=1),
                "attention_mask": attention_mask,
                "position_ids": position_ids(attention_mask),
            }
        )
    )
    out.meta["temperature"] = 1.0 if params.greedy or params.temperature == 0 else params.temperature
    return out


def samples_batch(prompts: Batch, params: SamplingParams, tokens: list[list[int]], log_probs: list[list[float]], pad: int) -> Batch:
    """``rollout_batch`` from per-sample token lists of an engine that stops at the first stop
    token and keeps it (vLLM, SGLang): every listed token is a response token (mask 1), then
    right padding with ``pad``. tokens, log_probs: ``B*n`` lists, prompt i's samples at i*n .. i*n+n-1."""
    width = max((len(t) for t in tokens), default=0)
    responses = torch.full((len(tokens), width), pad, dtype=prompts["input_ids"].dtype)
    lp = torch.zeros(len(tokens), width, dtype=torch.float32)
    response_mask = torch.zeros(len(tokens), width, dtype=torch.long)
    for i, (t, p) in enumerate(zip(tokens, log_probs)):
        responses[i, : len(t)] = torch.tensor(t, dtype=responses.dtype)
        lp[i, : len(p)] = torch.tensor(p, dtype=torch.float32)
        response_mask[i, : len(t)] = 1
    return rollout_batch(prompts, params, responses, response_mask, lp)


class RolloutEngine(ABC):
    """A generation engine. Registered as a factory ``make_engine(spec) -> RolloutEngine``.

    weight_dtype: the dtype the engine holds its weights in, when its options name one (a weight
    sync has the trainer export in it, e.g. bfloat16); None: unknown (``auto``), sent as trained.
    adapter_sync: a policy's LoRA adapter reaches this engine alone (:meth:`load_adapter`), on the
    base weights it loaded once; False: as merged full weights (:meth:`load_weights`).
    model_inputs: the prompt fields :meth:`generate` reads (default ``MODEL_INPUTS``: token ids,
    attention mask, positions); the rollout ships these to the engine and nothing more, so an
    engine that reads more (an image's ``pixel_values``) declares them."""

    weight_dtype: torch.dtype | None = None
    adapter_sync: bool = False
    model_inputs: tuple[str, ...] = MODEL_INPUTS

    @abstractmethod
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample ``params.n`` responses per prompt.

        prompts: ``input_ids`` and ``attention_mask`` ``(batch, prompt_len)``, left-padded.
        Returns ``batch * n`` samples, grouped by prompt (prompt i's samples at i*n .. i*n+n-1):
        ``prompts`` ``(batch*n, prompt_len)``, ``responses``, ``response_mask``,
        ``rollout_log_probs`` ``(batch*n, response_len)`` right-padded, and ``input_ids``,
        ``attention_mask``, ``position_ids`` ``(batch*n, prompt_len + response_len)``.
        """

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams, images: dict | None = None) -> Generation:
        """One sample for one prompt given as token ids (the multi-turn loop calls this); ``images``:
        the prompt's :data:`~trellis.interfaces.backend.IMAGE_INPUTS` (only an engine that lists the
        field in its ``model_inputs`` is given them)."""
        raise NotImplementedError(f"{type(self).__name__} has no async generation")

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        """Replace the engine's weights with these full tensors (Hugging Face names), in memory.
        ``shapes``: the update's manifest, name -> full shape in the order ``weights`` yields them
        (the trainer's ``weight_shapes()``): the engine checks it before reading any tensor, then
        reads ``weights`` once, lazily, one tensor at a time. None: ``weights`` may be read whole
        (e.g. a list) and is checked before loading."""

    def load_adapter(self, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        """Sample from now on with this LoRA adapter on the base weights (only when
        :attr:`adapter_sync`): ``adapter_config.json``'s fields and the tensors under PEFT's names,
        as ``Backend.export_adapter`` gives them."""
        raise NotImplementedError(f"{type(self).__name__} takes merged weights only")

    def adopt_module(self, module: torch.nn.Module) -> bool:
        """Generate from ``module``, the actor's own model in this process (its one rank holds the
        weights whole), instead of a copy: True if this engine does so from now on (it then sees
        every update as it happens, and weight syncs are skipped); False (the default) to keep
        its own weights and take syncs."""
        return False

    def weight_checksums(self, names: Sequence[str]) -> dict[str, str] | None:
        """After a weight sync: ``tensor_digest`` (:mod:`trellis.interfaces.transport`) of each of
        ``names`` (the trainer's names) as the engine now holds it, a name it does not hold left
        out; None (the default): it cannot tell, and the fixed-probe check (``sync_check``) is the
        only check of the sync."""
        return None

    def sleep(self) -> None:
        """Free what generation holds (KV cache and weights) between rollouts; a no-op if unsupported."""

    def wake(self, tags: Iterable[str] = ALL_MEMORY) -> None:
        """Undo ``sleep`` for ``tags`` (``WEIGHTS``, ``KV_CACHE``): a weight sync wakes the weights
        alone, loads them, then wakes the KV cache (see :func:`sync_engine`)."""

    def close(self) -> None:
        """Release the engine (its processes, threads, memory); the controllers call it at shutdown.
        Calling it twice is harmless."""


def sync_engine(engine: RolloutEngine, weights: Iterable[tuple[str, torch.Tensor]], shapes: Mapping[str, Sequence[int]] | None = None) -> None:
    """Load new weights into a possibly sleeping engine with the least memory at once (see
    :func:`weights_awake`). ``shapes``: the update's manifest (see :meth:`RolloutEngine.load_weights`)."""
    with weights_awake(engine):
        engine.load_weights(weights, shapes=shapes)


@contextlib.contextmanager
def weights_awake(engine: RolloutEngine) -> Iterator[None]:
    """The window a weight or adapter update runs in: free the trainer's cached blocks and wake the
    engine's weights alone; after the update, free the export's buffers, then wake the KV cache."""
    _free_cached()
    engine.wake([WEIGHTS])
    yield
    _free_cached()
    engine.wake([KV_CACHE])


def _free_cached() -> None:
    """Hand the CUDA caching allocator's unused blocks back, so the engine (another allocator) can take them."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
