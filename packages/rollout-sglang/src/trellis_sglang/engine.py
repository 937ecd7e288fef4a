"""Rollout on SGLang's offline engine: n samples per prompt from token ids, sampled-token log-probs
at the sampling temperature, weight sync from the actor in buckets (serialised tensors, or a
broadcast over a process group shared with the engine), sleep/wake by memory tag, async generation
for multi-turn.

``sglang.Engine`` runs the model in a scheduler subprocess; this process holds its tokenizer
manager, whose asyncio tasks live on one event loop for the engine's lifetime. That loop runs in a
private thread, so ``generate``, ``load_weights`` and ``agenerate`` (from any caller's event loop,
e.g. one ``asyncio.run`` per multi-turn batch) all submit coroutines to it.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from multiprocessing import resource_tracker
from typing import Any

import torch

from trellis import Batch
from trellis.kit.engine import (
    ALL_MEMORY,
    WEIGHTS,
    Generation,
    RolloutEngine,
    RolloutSpec,
    SamplingParams,
    checkpoint_names,
    context_length,
    engine_dtype,
    engine_weights,
    log_once,
    option_dtype,
    pad_id,
    prepare_update,
    samples_batch,
    sleep_skipped,
    stop_ids,
    weight_buckets,
)
from trellis_sglang.options import SGLangRolloutOptions

log = logging.getLogger("trellis")

CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536
_SEED_MOD = 2**63 - 1


def make_engine(spec: RolloutSpec) -> RolloutEngine:
    return SGLangRollout(spec)


class SGLangRollout(RolloutEngine):
    """An ``sglang.Engine`` behind the Trellis rollout interface."""

    def __init__(self, spec: RolloutSpec) -> None:
        self.opts: SGLangRolloutOptions = spec.options if spec.options is not None else SGLangRolloutOptions()
        self.on_cpu = not torch.cuda.is_available()
        self.opts.check(None if self.on_cpu else torch.cuda.current_device())
        self.tokenizer = spec.tokenizer
        self.model_path = str(spec.model_path)
        if self.on_cpu:
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        try:
            import psutil
            import sglang
        except ImportError as exc:
            raise ImportError(f"rollout 'sglang' needs SGLang ({exc}); install `sglang` (see the trellis-rollout-sglang README)") from exc
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(self.model_path)
        self.expected_shapes, self.tied = engine_weights(self.model_path, hf_config)
        self.to_checkpoint = checkpoint_names(hf_config)  # the trainer's in-memory names are not all the checkpoint's (MoE experts)
        self.weight_dtype = option_dtype(engine_dtype(self.opts.dtype, not self.on_cpu))

        kwargs = engine_args(self.opts, spec, hf_config, self.on_cpu)
        self.context_length = kwargs.get("context_length", 0)
        self.sleep_supported = bool(kwargs.get("enable_memory_saver"))
        self.seeded = bool(kwargs.get("enable_deterministic_inference"))  # SGLang honours per-request seeds only then

        # SGLang's Engine takes the current thread's event loop; give it a private one, run in a thread.
        self._loop = asyncio.new_event_loop()
        start = time.perf_counter()
        # Python's multiprocessing resource tracker, which the engine's start would otherwise launch, is this
        # process's, not the engine's: killed by close(), it would leak the semaphores it tracks.
        resource_tracker.ensure_running()
        before = {p.pid for p in psutil.Process().children()}
        asyncio.set_event_loop(self._loop)
        try:
            self.engine = sglang.Engine(**kwargs)
        finally:
            asyncio.set_event_loop(None)
        self._children = [p.pid for p in psutil.Process().children() if p.pid not in before]  # this engine's processes
        self.startup_s = time.perf_counter() - start
        self._thread = threading.Thread(target=self._loop.run_forever, name="trellis-sglang-loop", daemon=True)
        self._thread.start()
        # An engine nobody closed (e.g. one a recipe run built) is closed at exit by close(), not by
        # SGLang's own shutdown hook, which could hang the exiting process on a busy scheduler.
        atexit.unregister(self.engine.shutdown)
        atexit.register(self.close)

        self.pad_id = pad_id(self.tokenizer)
        self.eos_ids = stop_ids(self.model_path, self.tokenizer, hf_config)

        self.sleeping: set[str] = set()  # memory tags released by sleep() and not resumed yet
        self.backend = "gloo" if self.on_cpu else "nccl"  # of the distributed weight sync's group
        self._group = None  # made at the first distributed sync
        self._group_name = ""
        self._closed = False
        self.last_sync_s = 0.0
        self._ids = itertools.count()

    def _run(self, coro) -> Any:
        """Run a coroutine of SGLang's on the engine's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Stop this engine's subprocesses and loop. Not ``Engine.shutdown``: in SGLang 0.5.23 that
        ends every child process of this process, and another engine's watchdog, seeing its own
        processes gone, then kills this whole process."""
        from sglang.srt.utils import kill_process_tree

        if self._closed:
            return
        self._closed = True
        watchdog = getattr(self.engine.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        for pid in self._children:
            kill_process_tree(pid)
        _unlink_load_snapshot(self.engine)
        atexit.unregister(self.close)
        if self._group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self._group)
            self._group = None
        try:  # the tokenizer manager's tasks end now, not as "destroyed but pending" at exit
            asyncio.run_coroutine_threadsafe(_cancel_tasks(), self._loop).result(timeout=10)
        except Exception as exc:  # noqa: BLE001 - closing goes on regardless
            log.debug("rollout 'sglang': cancelling the engine loop's tasks: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        _close_zmq(self.engine, self.engine.tokenizer_manager)

    # -- generation ---------------------------------------------------------------------------
    def _sampling(self, params: SamplingParams, seed: int | None) -> dict[str, Any]:
        greedy = params.greedy or params.temperature == 0
        sampling = {
            "temperature": 0.0 if greedy else params.temperature,
            "top_p": 1.0 if greedy else params.top_p,
            "top_k": -1 if greedy or params.top_k <= 0 else params.top_k,  # SGLang: -1 is off
            "max_new_tokens": params.max_new_tokens,
            "stop_token_ids": sorted(self.eos_ids | set(params.stop_token_ids)),
        }
        if seed is not None:
            if not self.seeded:
                log_once("sglang-seed", "rollout 'sglang': per-request seeds need SGLang's enable_deterministic_inference "
                              "(not available with the torch_native attention of CPU runs); sampling is seeded per engine only")  # fmt: skip
            sampling["sampling_seed"] = seed % _SEED_MOD
        return sampling

    def _ready(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"rollout 'sglang' is closed; {what}() needs a new engine")
        asleep = self.sleeping & {WEIGHTS} if what == "load_weights" else self.sleeping
        if asleep:
            raise RuntimeError(f"rollout 'sglang' is asleep ({', '.join(sorted(asleep))}); call wake() before {what}")

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self._ready("generate")
        ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
        rows = [row[keep].tolist() for row, keep in zip(ids, mask)]
        input_ids = [r for r in rows for _ in range(params.n)]  # prompt i's samples at i*n .. i*n+n-1
        sampling = [self._sampling(params, params.sample_seed(k)) for k in range(len(input_ids))]
        outputs = self._run(self.engine.async_generate(input_ids=input_ids, sampling_params=sampling, return_logprob=True))
        tokens = [list(o["output_ids"]) for o in outputs]
        log_probs = [_sampled_log_probs(o) for o in outputs]
        return samples_batch(prompts, params, tokens, log_probs, self.pad_id)

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """One sample. Concurrent calls are concurrent SGLang requests, batched by its scheduler; a
        cancelled call is aborted in the engine."""
        self._ready("agenerate")
        rid = f"trellis-async-{next(self._ids)}"
        request = self.engine.async_generate(
            input_ids=list(prompt_ids), sampling_params=self._sampling(params, params.seed), return_logprob=True, rid=rid
        )
        try:
            out = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(request, self._loop))
        except asyncio.CancelledError:
            self._loop.call_soon_threadsafe(self.engine.tokenizer_manager.abort_request, rid)
            raise
        reason = out["meta_info"]["finish_reason"]["type"]
        if reason not in ("stop", "length"):
            raise RuntimeError(f"rollout 'sglang': request {rid} ended with finish_reason={out['meta_info']['finish_reason']!r}")
        return Generation(list(out["output_ids"]), _sampled_log_probs(out), reason)

    # -- weights -------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        """Update the weights in place, in buckets of about ``sync_bucket_mb`` MiB, inside SGLang's
        begin/end weight-update calls, then the prefix cache (KV of the old weights) is flushed.
        ``sync_method``: ``tensor`` hands each bucket over serialised (``update_weights_from_tensor``:
        CUDA IPC handles on a GPU, shared memory on CPU, see :func:`tensor_payloads`);
        ``distributed`` broadcasts it from this process over a process group it shares with the
        engine's (``update_weights_from_distributed``; gloo on CPU, NCCL on GPU). The update (or its
        manifest ``shapes``, then the stream is read a bucket at a time) is checked first; a refused
        one raises :class:`~trellis.kit.engine.WeightSyncError` and leaves the engine as it was."""
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

        self._ready("load_weights")
        start = time.perf_counter()
        update = prepare_update(weights, self.expected_shapes, self.tied, shapes=shapes, rename=self.to_checkpoint)
        if not update.manifest:
            return
        manager = self.engine.tokenizer_manager
        send = self._send_distributed if self.opts.sync_method == "distributed" else self._send_tensors
        self._check(self._run(manager.begin_weight_update(BeginWeightUpdateReqInput(), None)), "begin_weight_update")
        try:
            for bucket, last in _with_last(weight_buckets(update.tensors, int(self.opts.sync_bucket_mb * (1 << 20)))):
                send(bucket, flush_cache=last)
        finally:
            self._check(self._run(manager.end_weight_update(EndWeightUpdateReqInput(), None)), "end_weight_update")
            if not self.on_cpu:  # torch holds CUDA memory it sent by IPC until collected, past empty_cache
                torch.cuda.ipc_collect()
        self.last_sync_s = time.perf_counter() - start

    def _send_tensors(self, bucket: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        device = torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())
        payloads = tensor_payloads(bucket, self.opts.tensor_parallel_size, device)
        obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, flush_cache=flush_cache)
        self._check(self._run(self.engine.tokenizer_manager.update_weights_from_tensor(obj, None)), "update_weights_from_tensor")

    def _send_distributed(self, bucket: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
        """The engine posts one receive per tensor, in order; this process broadcasts them while
        the request is in flight."""
        import torch.distributed as dist
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        group = self._update_group()
        device = "cuda" if self.backend == "nccl" else "cpu"
        obj = UpdateWeightsFromDistributedReqInput(
            names=[n for n, _ in bucket],
            dtypes=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
            shapes=[list(t.shape) for _, t in bucket],
            group_name=self._group_name,
            flush_cache=flush_cache,
        )
        request = asyncio.run_coroutine_threadsafe(self.engine.tokenizer_manager.update_weights_from_distributed(obj, None), self._loop)
        for _, tensor in bucket:
            dist.broadcast(tensor.detach().to(device).contiguous(), src=0, group=group)
        self._check(request.result(), "update_weights_from_distributed")

    def _update_group(self):
        """The process group this process (rank 0) shares with the engine's tensor-parallel ranks
        (1..tp), made at the first distributed sync: both sides join at once."""
        if self._group is not None:
            return self._group
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput
        from sglang.srt.utils import init_custom_process_group

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        world = 1 + self.opts.tensor_parallel_size
        self._group_name = f"trellis_weight_update_{port}"  # torch refuses a group name twice in a process (several engines)
        obj = InitWeightsUpdateGroupReqInput(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=world, group_name=self._group_name, backend=self.backend
        )
        joined = asyncio.run_coroutine_threadsafe(self.engine.tokenizer_manager.init_weights_update_group(obj, None), self._loop)
        self._group = init_custom_process_group(
            backend=self.backend, init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=0, group_name=self._group_name
        )
        self._check(joined.result(), "init_weights_update_group")
        return self._group

    @staticmethod
    def _check(result: tuple[bool, str], call: str) -> None:
        success, message = result
        if not success:
            raise RuntimeError(f"rollout 'sglang': {call} failed: {message}")

    # -- sleep / wake --------------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        return bool(self.sleeping)

    def sleep(self) -> None:
        """Release the weights and KV cache (GPU with ``enable_memory_saver``); a logged no-op on CPU."""
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        if not self.sleep_supported:
            sleep_skipped("sglang", "on CPU (SGLang's memory release needs CUDA)" if self.on_cpu else "with enable_memory_saver off")
            return
        if self.sleeping:
            return
        self._run(self.engine.tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=list(ALL_MEMORY)), None))
        self.sleeping = set(ALL_MEMORY)

    def wake(self, tags: Iterable[str] = ALL_MEMORY) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        tags = [t for t in tags if t in self.sleeping]
        if not tags:
            return
        self._run(self.engine.tokenizer_manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags), None))
        self.sleeping -= set(tags)


async def _cancel_tasks() -> None:
    """Cancel every other task of the running loop and wait for them to end."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def engine_args(opts: SGLangRolloutOptions, spec: RolloutSpec, hf_config, on_cpu: bool) -> dict[str, Any]:
    """The ``sglang.Engine`` keyword arguments for these options. Tensor parallel (``tp_size``) is
    the engine's own: one engine spans ``tensor_parallel_size`` devices of this machine."""
    if on_cpu and opts.tensor_parallel_size > 1:
        raise ValueError(
            f"rollout.tensor_parallel_size={opts.tensor_parallel_size}: SGLang's tensor parallel communicates over NCCL "
            "(its pynccl communicator) and needs CUDA devices; on CPU set rollout.tensor_parallel_size=1"
        )
    kwargs: dict[str, Any] = {
        "model_path": str(spec.model_path),
        "dtype": engine_dtype(opts.dtype, not on_cpu),
        "random_seed": opts.seed if opts.seed is not None else spec.seed,
        "tp_size": opts.tensor_parallel_size,
        "skip_tokenizer_init": True,  # token ids in, token ids out: the trainer's tokenizer decodes
        "disable_cuda_graph": on_cpu if opts.disable_cuda_graph is None else opts.disable_cuda_graph,
        "log_level": opts.log_level,
        "mem_fraction_static": opts.mem_fraction_static,
    }
    length = context_length(spec, opts.context_length, hf_config)
    if length:
        kwargs["context_length"] = length
    max_total = opts.max_total_tokens or (CPU_DEFAULT_MAX_TOTAL_TOKENS if on_cpu else 0)
    if max_total:
        kwargs["max_total_tokens"] = max_total
    if opts.attention_backend or on_cpu:
        kwargs["attention_backend"] = opts.attention_backend or "torch_native"
    if on_cpu:
        kwargs["device"] = "cpu"
    if not on_cpu and opts.enable_memory_saver:
        kwargs["enable_memory_saver"] = True
    return kwargs | opts.engine_kwargs


def tensor_payloads(bucket: list[tuple[str, torch.Tensor]], tp_size: int, device: torch.device) -> list[bytes]:
    """``bucket`` as ``update_weights_from_tensor`` takes it: one pickle per tensor-parallel rank of
    the tensors moved to ``device``, the engine's. On CPU they are host copies in shared memory
    (``/dev/shm``); on a GPU they stay on the device (a host tensor is copied there, a bucket at a
    time) and travel as CUDA IPC handles, through no host memory.

    SGLang 0.5.23 facts relied on: each TP rank unpickles only the payload at its rank
    (``TpModelWorker.deserialize_own_rank``, ``srt/managers/tp_worker.py``), which is why
    ``Engine._serialize_tensors_per_rank`` (``srt/entrypoints/engine.py``) pickles once per rank: a
    CUDA tensor's pickle holds a producer-side IPC reference that one unpickling releases; the rank
    then moves each tensor to its own device (``_unwrap_tensor``,
    ``model_runner_components/weight_updater.py``). SGLang's ``monkey_patch_torch_reductions``
    (``srt/utils/patch_torch.py``) is not applied here: the ranks apply it and read a device index
    as well as its UUID, and the index names the same GPU there, since the engine's processes
    inherit this one's ``CUDA_VISIBLE_DEVICES`` (unless ``SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS``);
    in this process it would break every later multiprocessing pickle of a CPU tensor (IndexError,
    seen with SGLang 0.5.23 on CPU)."""
    from sglang.srt.utils import MultiprocessingSerializer

    named = [(name, t.detach().to(device)) for name, t in bucket]  # a tensor already there is not copied
    return [MultiprocessingSerializer.serialize(named) for _ in range(tp_size)]


_END = object()


def _with_last(items: Iterable) -> Iterator[tuple[Any, bool]]:
    """Each item with whether it is the last, reading one item ahead."""
    it = iter(items)
    current = next(it, _END)
    while current is not _END:
        following = next(it, _END)
        yield current, following is _END
        current = following


def _sampled_log_probs(output: dict) -> list[float]:
    """The sampled tokens' log-probs from a request made with ``return_logprob=True``."""
    entries = output["meta_info"].get("output_token_logprobs")
    if entries is None:
        raise RuntimeError("SGLang returned no log-probs; the request must set return_logprob=True")
    return [float(e[0]) for e in entries]


def load_snapshot_path(engine: Any) -> str:
    """The /dev/shm file in which the engine's schedulers publish their load (SGLang's
    ``load_snapshot``), named by the engine's instance id."""
    from sglang.srt.managers.load_snapshot import shm_path_for

    return shm_path_for(engine.port_args.instance_id)


def _unlink_load_snapshot(engine: Any) -> None:
    """Removes the engine's load file: SGLang never unlinks it (its own CI sweeps /dev/shm at job start),
    and killed schedulers could not, so each engine closed left one behind."""
    try:
        os.unlink(load_snapshot_path(engine))
    except FileNotFoundError:
        pass
    except (AttributeError, ImportError) as exc:  # an SGLang without load files, or a renamed one
        log.debug("rollout 'sglang': no load snapshot file to remove: %r", exc)


def _close_zmq(*owners: Any) -> None:
    """Close the ZeroMQ sockets the engine and its tokenizer manager hold, dropping unsent messages:
    their contexts would otherwise wait at interpreter exit (``Context.term`` in a garbage-collection
    pass) for a scheduler that is gone, and the process would never end."""
    import zmq

    contexts = {id(v.context): v.context for owner in owners for v in vars(owner).values() if isinstance(v, zmq.Socket)}
    for context in contexts.values():
        context.destroy(linger=0)
