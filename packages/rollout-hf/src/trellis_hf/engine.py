"""Rollout on ``transformers`` generate: n samples per prompt, sampled-token log-probs (recorded
during generation, one step's log-softmax at a time), in-memory weight updates from the actor, or
generation from the actor's own model when it lives whole in this process (``adopt_module``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import (
    DynamicCache,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicLayer

from trellis import Batch, choice, ranged
from trellis.kit.engine import (
    IMAGE_INPUTS,
    MODEL_INPUTS,
    ROUTED_EXPERTS,
    Generation,
    RolloutEngine,
    RolloutSpec,
    Routes,
    SamplingParams,
    causal_lm_class,
    engine_dtype,
    generated_routes,
    grouped_query_sdpa,
    image_kwargs,
    left_pad,
    own_routing,
    pad_id,
    prepare_update,
    recorded_routes,
    rollout_batch,
    sampling_generator,
    stop_ids,
    tensor_digest,
)

_Request = tuple[list[int], SamplingParams, "asyncio.Future[Generation]", dict]  # prompt ids, sampling, result, its images

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class HFRolloutOptions:
    """dtype: weights and compute (None: bfloat16 on a GPU, float32 on CPU). micro_batch_prompts: prompts per generate call (0: all).
    device: ``auto`` (cuda when available), ``cuda`` or ``cpu``. share_actor_weights: when the
    actor's one rank holds its model whole in this process, in this engine's dtype and device,
    generate from that model (no copy of the weights, no sync after each update); false: keep a
    copy and sync it. share_prompts: a prompt that several rows of one ``generate`` call start from
    (the ``n`` samples of a prompt, concurrent requests of one conversation) is run once and its KV
    cache repeated for each row, as vLLM's prefix caching would (models with a plain per-layer
    cache; a sliding-window, static or hybrid cache, images or recorded routes run every row)."""

    dtype: str | None = choice(None, tuple(DTYPES))
    micro_batch_prompts: int = ranged(0, ge=0)
    device: str = choice("auto", ("auto", "cuda", "cpu"))
    share_actor_weights: bool = True
    share_prompts: bool = True


def make_engine(spec: RolloutSpec) -> RolloutEngine:
    return HFRollout(spec)


class HFRollout(RolloutEngine):
    model_inputs = (*MODEL_INPUTS, IMAGE_INPUTS)  # a vision-language model's images too

    def __init__(self, spec: RolloutSpec) -> None:
        self.opts: HFRolloutOptions = spec.options if spec.options is not None else HFRolloutOptions()
        if self.opts.dtype is not None and self.opts.dtype not in DTYPES:
            raise ValueError(f"rollout.dtype={self.opts.dtype!r} is not a dtype; valid: {', '.join(DTYPES)} (or null: by device)")
        self.tokenizer = spec.tokenizer
        use_cuda = self.opts.device == "cuda" or (self.opts.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if use_cuda else "cpu")
        self.weight_dtype = DTYPES[engine_dtype(self.opts.dtype, use_cuda)]
        self.model_path = spec.model_path
        self._model: torch.nn.Module | None = None  # read from the folder on first use, unless the actor's is adopted
        self.pad_id = pad_id(self.tokenizer)
        self.eos_ids = stop_ids(spec.model_path, self.tokenizer)
        self._queue: list[_Request] = []  # async requests waiting for the next batch
        self._server: asyncio.Task | None = None
        self.batch_sizes: deque[int] = deque(maxlen=256)  # sizes of the latest async batches
        self.generator = sampling_generator(self.device, spec.seed)  # requests without a seed draw from it

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            grouped_query_sdpa()
            self._model = causal_lm_class(self.model_path).from_pretrained(self.model_path, dtype=self.weight_dtype).to(self.device).eval()
        return self._model

    def adopt_module(self, module: torch.nn.Module) -> bool:
        """Generate from the actor's ``module`` (put in eval mode for each generation, its mode
        restored after) when ``share_actor_weights`` is on and its weights are in this engine's
        dtype and on its device."""
        param = next(module.parameters())
        if not self.opts.share_actor_weights or param.dtype != self.weight_dtype or param.device.type != self.device.type:
            return False
        self._model = module
        return True

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        generator = self._generator(params)
        size = self.opts.micro_batch_prompts or len(prompts)
        parts = [self._generate_tokens(p, params, generator) for p in prompts.split(size)]
        width = max(p[0].shape[1] for p in parts)
        responses = torch.cat([_pad_right(r, width, self.pad_id) for r, _, _ in parts])
        log_probs = torch.cat([_pad_right(lp, width, 0.0) for _, lp, _ in parts])
        stops = self.eos_ids | set(params.stop_token_ids)
        out = rollout_batch(prompts, params, responses, _mask_through_first_stop(responses, stops), log_probs)
        if all(routes is not None for _, _, routes in parts):  # asked for, of a mixture-of-experts model
            full = out["input_ids"].shape[1]  # -1 in the columns no forward ran
            routes = torch.cat([torch.nn.functional.pad(r, (0, 0, 0, 0, 0, full - r.shape[1]), value=-1) for _, _, r in parts])
            out[ROUTED_EXPERTS] = routes.masked_fill(~out["attention_mask"].bool()[..., None, None], -1)
        return out

    def _generator(self, params: SamplingParams) -> torch.Generator:
        """The generator a call samples from: one seeded with ``params.seed``, else the engine's own."""
        return self.generator if params.seed is None else torch.Generator(self.device).manual_seed(params.seed)

    def _generate_tokens(
        self, prompts: Batch, params: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Sampled tokens ``(b*n, new)``, their log-probs under softmax(logits / temperature), and with
        ``return_routed_experts`` the experts each prompt and sampled token but the last (which no forward
        ran) went to ``(b*n, prompt_len + new - 1, layers, top_k)``."""
        ids = prompts["input_ids"].repeat_interleave(params.n, dim=0).to(self.device)
        mask = prompts["attention_mask"].repeat_interleave(params.n, dim=0).to(self.device)
        per_prompt = prompts.get(IMAGE_INPUTS)
        images = image_kwargs(self.model.config, ids, None if per_prompt is None else [x for x in per_prompt for _ in range(params.n)])
        greedy = params.greedy or params.temperature == 0
        recorder = _SampledLogProbs(1.0 if greedy else params.temperature)
        processors = [recorder] if greedy else [recorder, _Sampler(params, generator)]
        model, training = self.model, self.model.training
        model.eval()  # an adopted actor's model is in training mode: no dropout while sampling
        own_routing(model)  # nor the routes its last training forward replayed
        recording = recorded_routes(model) if params.return_routed_experts else contextlib.nullcontext()
        shared = self.opts.share_prompts and not images and not params.return_routed_experts
        try:
            with torch.no_grad(), recording as calls:
                cache = _shared_prefill(model, ids, mask) if shared else None
                # generate decodes greedily: _Sampler leaves the drawn token the only one possible
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    **{k: v for k, v in images.items() if k not in ("input_ids", "position_ids")},  # generate lays out the positions
                    do_sample=False,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                    max_new_tokens=params.max_new_tokens,
                    eos_token_id=sorted(self.eos_ids | set(params.stop_token_ids)),
                    pad_token_id=self.pad_id,
                    logits_processor=LogitsProcessorList(processors),
                    use_cache=True,  # a trainer's model has the KV cache off in its config
                    **({"past_key_values": cache} if cache is not None else {}),
                )
        finally:
            model.train(training)
        routes = generated_routes(calls, len(out)) if calls else None  # a dense model has no routers to record
        return out[:, ids.shape[1] :].cpu(), recorder.result(out).cpu(), routes

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams, images: dict | None = None) -> Generation:
        """One sample. Concurrent calls are batched: the requests waiting when a batch starts go
        into one ``generate`` call per sampling setting (each stops at its own token limit);
        requests that arrive meanwhile wait for the next batch."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append((list(prompt_ids), params, future, images or {}))
        if self._server is None or self._server.done():
            self._server = loop.create_task(self._serve())
        return await future

    async def _serve(self) -> None:
        while self._queue:
            await asyncio.sleep(0)  # requests started in the same event-loop tick join this batch
            waiting, self._queue = [r for r in self._queue if not r[2].done()], []
            groups: dict[tuple, list[_Request]] = {}
            for request in waiting:
                p = request[1]
                key = (p.greedy, p.temperature, p.top_p, p.top_k, tuple(p.stop_token_ids), p.return_routed_experts)
                groups.setdefault(key, []).append(request)
            for group in groups.values():
                try:
                    results = await asyncio.to_thread(_stop_iteration_raised, self._generate_group, group)
                except Exception as exc:  # noqa: BLE001 - every caller of this batch gets the error
                    results = [exc] * len(group)
                for (_, _, future, _), result in zip(group, results):
                    if future.done():  # the caller was cancelled
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)

    def _generate_group(self, group: list[_Request]) -> list[Generation]:
        params = group[0][1]
        ids, mask, _ = left_pad([r[0] for r in group], self.pad_id)
        longest = max(r[1].max_new_tokens for r in group)
        tokens, log_probs, routes = self._generate_tokens(
            Batch({"input_ids": ids, "attention_mask": mask}, {IMAGE_INPUTS: [r[3] for r in group]}),
            SamplingParams(**{**params.__dict__, "n": 1, "max_new_tokens": longest}),
            self._generator(params),
        )
        self.batch_sizes.append(len(group))
        stops = self.eos_ids | set(params.stop_token_ids)
        lengths = _mask_through_first_stop(tokens, stops).sum(-1).tolist()
        out = []
        for row, (_, p, _, _) in enumerate(group):
            n = min(lengths[row], p.max_new_tokens)
            taken = tokens[row, :n].tolist()
            stopped = bool(taken) and taken[-1] in stops
            out.append(Generation(taken, log_probs[row, :n].tolist(), "stop" if stopped else "length", _routes(ids, mask, routes, row, taken)))
        return out

    # -- weights -------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        """Copy full tensors into the model in place. Names and shapes (of the update, or of its
        manifest ``shapes``, then the stream is copied one tensor at a time) are checked before any
        copy, so a refused update leaves the old weights whole. The model's own modules: no fused
        ones, and a tied head shares the embedding's tensor."""
        state = self.model.state_dict()
        update = prepare_update(weights, {name: tuple(t.shape) for name, t in state.items()}, tied={}, packed={}, shapes=shapes)
        with torch.no_grad():
            for name, tensor in update.tensors:
                state[name].copy_(tensor)

    def weight_checksums(self, names: Sequence[str]) -> dict[str, str]:
        """The digest of each named tensor the model holds (its own names are the trainer's)."""
        state = self.model.state_dict()
        return {name: tensor_digest(state[name]) for name in names if name in state}


def _shared_prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> DynamicCache | None:
    """The KV cache of every row's prompt but its last token ``(rows, ..., width - 1, ...)``,
    computed once for each distinct prompt (tokens and padding) and repeated for its rows, at the
    positions ``generate`` gives a left-padded prompt; ``generate`` then runs the last prompt token
    of each row and samples. None when no two rows share a prompt, the prompts are one token
    wide, or the model's cache is not plain per-layer keys and values (a sliding window, a static
    or hybrid cache), which ``batch_select_indices`` might not repeat whole."""
    if ids.shape[1] < 2 or getattr(model.generation_config, "cache_implementation", None):
        return None
    width = ids.shape[1]
    distinct, rows = torch.unique(torch.cat([ids, mask], 1), dim=0, return_inverse=True)
    if len(distinct) == len(ids):
        return None
    prompt, prompt_mask = distinct[:, : width - 1], distinct[:, width : 2 * width - 1]
    positions = (prompt_mask.long().cumsum(-1) - 1).masked_fill(prompt_mask == 0, 1)
    cache = model(input_ids=prompt, attention_mask=prompt_mask, position_ids=positions, use_cache=True, logits_to_keep=1).past_key_values
    if not isinstance(cache, DynamicCache) or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.batch_select_indices(rows)
    return cache


class _Sampler(LogitsProcessor):
    """Draws each row's next token from ``generator`` under temperature, top-k and top-p (in
    ``generate``'s own order and with its warpers) and leaves it the only token possible, so that
    ``generate``, decoding greedily, takes it and never draws from torch's global generator."""

    def __init__(self, params: SamplingParams, generator: torch.Generator) -> None:
        warpers = [TemperatureLogitsWarper(params.temperature)]
        if params.top_k > 0:
            warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            warpers.append(TopPLogitsWarper(params.top_p))
        self.warpers, self.generator = LogitsProcessorList(warpers), generator

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.warpers(input_ids, scores.float()), dim=-1)
        drawn = torch.multinomial(probs, 1, generator=self.generator)
        return torch.full_like(scores, -torch.inf).scatter_(1, drawn, 0.0)


class _SampledLogProbs(LogitsProcessor):
    """Records each sampled token's log-prob under softmax(logits / temperature) while ``generate``
    runs, keeping one step's ``(rows, vocab)`` log-softmax at a time instead of every step's logits
    (``output_logits=True`` holds ``(rows, steps, vocab)``). Custom processors run before
    ``generate``'s sampling warpers, so ``scores`` are the raw logits; the token sampled at a step
    is read from ``input_ids`` at the next call (and from the sequences after the last step)."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.pending: torch.Tensor | None = None  # (rows, vocab) of the step whose token is not known yet
        self.steps: list[torch.Tensor] = []  # (rows, 1) per generated token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1:])
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, tokens))
            self.pending = None

    def result(self, sequences: torch.Tensor) -> torch.Tensor:
        """``(rows, generated)`` log-probs, given ``generate``'s output sequences."""
        self._take(sequences[:, -1:])
        return torch.cat(self.steps, dim=1) if self.steps else sequences.new_zeros((len(sequences), 0), dtype=torch.float32)


def _routes(ids: torch.Tensor, mask: torch.Tensor, routes: torch.Tensor | None, row: int, taken: list[int]) -> Routes | None:
    """Row ``row``'s routes of a left-padded group generation: its prompt's and its sampled tokens' but the last."""
    if routes is None:
        return None
    prompt = ids[row][mask[row].bool()].tolist()
    start = ids.shape[1] - len(prompt)
    inputs = prompt + taken[:-1]
    return Routes(inputs, routes[row, start : start + len(inputs)])


def _stop_iteration_raised(fn, *args):
    """``fn(*args)`` with a StopIteration it raises (transformers does, for an image slot without an
    image) turned into a RuntimeError: a future cannot hold one, and its callers would wait forever."""
    try:
        return fn(*args)
    except StopIteration as exc:
        raise RuntimeError(f"generation failed: StopIteration {exc}") from exc


def _pad_right(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def _mask_through_first_stop(tokens: torch.Tensor, stops: set[int]) -> torch.Tensor:
    """1 on every token up to and including the first stop token, 0 after: ``(b, len)``."""
    is_stop = torch.isin(tokens, torch.tensor(sorted(stops), dtype=tokens.dtype)).long()
    stops_before = is_stop.cumsum(-1) - is_stop
    return (stops_before == 0).long()
