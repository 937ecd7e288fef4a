"""The SGLang rollout against the real engine (on CPU here): the shared engine tests
(``tests/engine_cases.py``) plus SGLang's own: the distributed weight sync against the tensor one
(each from a list and streamed), tensor parallel reaching the engine, the distributed sync
refused on the trainer's own GPU, the tensor sync's payloads (host memory on CPU, the device on
a GPU), and the processes ``close()`` ends."""

from __future__ import annotations

import psutil
import pytest
import torch
from engine_cases import LONG, TEXTS, RolloutCases, checkpoint_state, forward_log_probs, greedy, perturbed, stream

from trellis.interfaces.rollout import RolloutSpec, SamplingParams
from trellis.interfaces.weights import WeightSyncError
from trellis_sglang import SGLangRolloutOptions
from trellis_sglang.engine import engine_args, load_snapshot_path, tensor_payloads

CPU = not torch.cuda.is_available()


class TestSGLangRollout(RolloutCases):
    ENGINE = "sglang"
    UNTIED_OPTIONS = {"sync_bucket_mb": 0.01}  # the untied engine syncs in 10 KiB buckets: many calls
    RANGED = 7
    CHOICES = 2  # dtype, sync_method
    OPEN_ENDED = ("attention_backend", "log_level")  # passed to SGLang
    CANCEL_AFTER_S = 0.2
    BAD_OPTIONS = [
        ({"dtype": "fp32"}, r"rollout.dtype='fp32' is not a dtype"),
        ({"sync_bucket_mb": 0}, r"rollout.sync_bucket_mb=0 must be positive"),
        ({"sync_method": "nccl"}, r"rollout.sync_method='nccl'; valid: tensor, distributed"),
    ]
    if CPU:  # SGLang's tensor parallel needs CUDA
        BAD_OPTIONS.append(({"tensor_parallel_size": 2}, r"tensor_parallel_size=2: .*needs CUDA devices; on CPU set rollout.tensor_parallel_size=1"))

    def files_outside(self, engine) -> list[str]:
        return [load_snapshot_path(engine.engine)]  # its schedulers' load, in /dev/shm

    def test_the_processes_close_ends_are_the_engines_own(self, engines):
        """close() kills the processes the engine's start added to this one. Python's multiprocessing
        resource tracker, which that start launches when nothing had before, is not among them: it
        belongs to this process and unlinks leaked semaphores at its exit."""
        for eng in engines.values():
            commands = [" ".join(psutil.Process(pid).cmdline()) for pid in eng._children]
            assert any("sglang::scheduler" in c for c in commands), commands
            assert not [c for c in commands if "resource_tracker" in c], commands

    @pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
    def test_distributed_sync_equals_tensor_sync(self, tied, engines, make_prompts, restore):
        """The same new weights through ``update_weights_from_distributed`` (broadcast over gloo from
        this process) and ``update_weights_from_tensor``, each from a list and streamed with its
        manifest (the untied engine in 10 KiB buckets): identical outputs and log-probs, which
        follow the new weights (a forward pass of the perturbed model)."""
        eng = engines["tied" if tied else "untied"]
        prompts = make_prompts(eng.tokenizer, TEXTS + LONG)
        other = perturbed(eng.model_path, seed=11)
        state = other.state_dict()
        if tied:
            state.pop("lm_head.weight")
        manifest = {name: t.shape for name, t in state.items()}
        restore(eng)
        results = []
        # back to tensor after distributed: the group does not get in its way
        for method, streamed in (("tensor", False), ("distributed", False), ("distributed", True), ("tensor", True)):
            eng.load_weights(checkpoint_state(eng.model_path).items())
            eng.opts.sync_method = method
            if streamed:
                eng.load_weights(stream(state.items()), shapes=manifest)
            else:
                eng.load_weights(list(state.items()))
            results.append((greedy(eng, make_prompts, TEXTS + LONG), eng.generate(prompts, SamplingParams(n=2, temperature=0.8, max_new_tokens=8))))
        eng.opts.sync_method = "tensor"
        assert eng._group is not None
        (g_first, _), *others = results
        for g_other, _ in others:
            assert torch.equal(g_other["responses"], g_first["responses"])
            torch.testing.assert_close(g_other["rollout_log_probs"], g_first["rollout_log_probs"], atol=1e-6, rtol=0)
        for _, sampled in results:
            expected = forward_log_probs(other, sampled, 0.8) * sampled["response_mask"]
            torch.testing.assert_close(sampled["rollout_log_probs"], expected, atol=1e-4, rtol=0)

    def test_refused_distributed_sync_leaves_the_engine_generating(self, engine, make_prompts):
        before = greedy(engine, make_prompts)
        state = checkpoint_state(engine.model_path)
        name = "model.layers.0.mlp.up_proj.weight"
        engine.opts.sync_method = "distributed"
        try:
            with pytest.raises(WeightSyncError, match=rf"'{name}' has shape \(3, 3\)"):
                engine.load_weights([("model.norm.weight", state["model.norm.weight"] + 1), (name, torch.zeros(3, 3))])
            after = greedy(engine, make_prompts)
        finally:
            engine.opts.sync_method = "tensor"
        assert torch.equal(after["responses"], before["responses"])
        torch.testing.assert_close(after["rollout_log_probs"], before["rollout_log_probs"], atol=1e-6, rtol=0)


def test_tensor_parallel_reaches_the_engine_as_tp_size(tiny_model_path):
    """No engine started: the arguments ``sglang.Engine`` would get. On GPU ``tp_size`` spans the
    devices; on CPU SGLang's tensor parallel fails (its pynccl communicator), so it is refused first."""
    from transformers import AutoConfig, AutoTokenizer

    spec = RolloutSpec(tiny_model_path, None, AutoTokenizer.from_pretrained(tiny_model_path), max_len=96)
    hf_config = AutoConfig.from_pretrained(tiny_model_path)
    args = engine_args(SGLangRolloutOptions(tensor_parallel_size=2), spec, hf_config, on_cpu=False)
    assert args["tp_size"] == 2 and args["context_length"] == 96 and args["enable_memory_saver"]
    assert engine_args(SGLangRolloutOptions(context_length=200), spec, hf_config, on_cpu=True)["context_length"] == 200
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel_size=2: SGLang's tensor parallel .*NCCL"):
        engine_args(SGLangRolloutOptions(tensor_parallel_size=2), spec, hf_config, on_cpu=True)


def test_distributed_sync_is_refused_on_the_trainers_own_gpu():
    """No engine started: the options check told the building process's CUDA device. NCCL takes one
    rank per GPU, so a broadcast from the trainer to an engine rank on its own GPU cannot start."""
    colocated = r"rollout.sync_method=distributed with the engine on GPU 1, .*NCCL refuses .*set rollout.sync_method=tensor"
    with pytest.raises(ValueError, match=colocated):
        SGLangRolloutOptions(sync_method="distributed", tensor_parallel_size=2).check(trainer_gpu=1)  # engine on GPUs 0, 1
    SGLangRolloutOptions(sync_method="distributed").check(trainer_gpu=None)  # CPU: gloo takes both ranks
    SGLangRolloutOptions(sync_method="distributed").check(trainer_gpu=1)  # engine on GPU 0
    spaced = SGLangRolloutOptions(sync_method="distributed", engine_kwargs={"base_gpu_id": 2, "gpu_id_step": 2}, tensor_parallel_size=2)
    spaced.check(trainer_gpu=3)  # engine on GPUs 2, 4
    with pytest.raises(ValueError, match=r"engine on GPU 4"):
        spaced.check(trainer_gpu=4)
    SGLangRolloutOptions(sync_method="tensor").check(trainer_gpu=0)  # the fix the message names


def test_tensor_sync_payloads_one_pickle_per_rank_on_the_engines_device():
    """No engine started: what ``update_weights_from_tensor`` gets, unpickled with SGLang's own
    deserializer (its scheduler's). On CPU: the host tensors themselves. The ``meta`` device stands
    in for a GPU engine's CUDA device (no GPU here): a host tensor goes to the engine's device, not
    through host memory, and each tensor-parallel rank gets a pickle of its own (one CUDA IPC
    release per pickle). The CUDA IPC handles themselves need a GPU."""
    from sglang.srt.utils import MultiprocessingSerializer

    bucket = [("model.norm.weight", torch.arange(4.0)), ("lm_head.weight", torch.ones(3, 2, dtype=torch.bfloat16))]
    (payload,) = tensor_payloads(bucket, 1, torch.device("cpu"))
    got = MultiprocessingSerializer.deserialize(payload)
    assert [n for n, _ in got] == ["model.norm.weight", "lm_head.weight"]
    assert all(t.device.type == "cpu" and torch.equal(t, want) for (_, t), (_, want) in zip(got, bucket))

    payloads = tensor_payloads(bucket, 2, torch.device("meta"))  # stand-in for the GPU engine's device
    assert len(payloads) == 2 and payloads[0] is not payloads[1]  # two pickles, not one sent twice
    for rank in payloads:
        got = MultiprocessingSerializer.deserialize(rank)
        assert [(n, t.device.type, t.shape, t.dtype) for n, t in got] == [
            ("model.norm.weight", "meta", (4,), torch.float32),
            ("lm_head.weight", "meta", (3, 2), torch.bfloat16),
        ]
