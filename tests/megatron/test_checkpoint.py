"""Checkpoints through Megatron's distributed checkpointing: a TP=2 actor saved after one update
and resumed in fresh processes takes the next update exactly as the uninterrupted one (metrics,
LR schedule, weights); the TP=2 checkpoint loads on one rank (TP=1, no optimizer) with the same
weights, as ``trellis export`` does."""

from __future__ import annotations

from itertools import chain

import pytest
import torch
from omegaconf import OmegaConf
from ranks import run_ranks
from test_training import rl_batch

from trellis.config import validate
from trellis.interfaces.dispatch import Mesh
from trellis.plugins import load_plugins
from trellis.runtime.worker import build_worker
from trellis_algos import ActorConfig
from trellis_megatron.options import MegatronOptions


def actor(info, path: str, tp: int, trainable: bool = True):
    registry = load_plugins().registry
    optim = {"lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 2}
    options = validate(OmegaConf.create({"micro_batch_samples": 4, "optim": optim, "policy_loss": {"name": "vanilla"}}), ActorConfig, registry)
    objectives = {"update": "policy"} if trainable else {}
    backend = MegatronOptions(tensor_parallel=tp)
    return build_worker(registry, "megatron", "actor", path, options, objectives, options=backend, dist=info, total_steps=3)


def batch_of_step(step: int, vocab: int):
    batch = rl_batch(vocab, seed=step)
    batch.meta["step"] = step
    return batch


def _run(info, path: str, folder: str, mode: str):
    """``straight``: update 1, save, update 2. ``resume``: load, update 2. ``export``: load on one
    rank without an optimizer and export."""
    worker = actor(info, path, info.mesh.tp, trainable=mode != "export")
    vocab = worker.backend.hf_config.vocab_size
    out = {}
    if mode == "straight":
        out["step1"] = worker.train("update", batch_of_step(1, vocab))
        worker.save(f"{folder}/actor")
        out["saved_weights"] = dict(chain.from_iterable(worker.export_weights(all_ranks=True)))
        # the RNG after the save: a resumed run must draw the same numbers
        out["rng"] = torch.rand(3)
    else:
        worker.load(f"{folder}/actor")
        out["rng"] = torch.rand(3)
    if mode != "export":
        out["step2"] = worker.train("update", batch_of_step(2, vocab))
    out["weights"] = dict(chain.from_iterable(worker.export_weights(all_ranks=True)))
    return out


def test_resume_equals_uninterrupted_and_reshards(tiny_untied_model_path, tmp_path):
    straight = run_ranks(_run, Mesh(tp=2), tiny_untied_model_path, str(tmp_path), "straight")
    assert {p.name for p in (tmp_path / "actor").iterdir()} >= {"metadata.json", ".metadata", "rank0.pt", "rank1.pt"}
    resumed = run_ranks(_run, Mesh(tp=2), tiny_untied_model_path, str(tmp_path), "resume")
    for s, r in zip(straight, resumed):
        assert r["step2"] == s["step2"]  # the LR (warm-up then cosine), the Adam moments, the weights
        assert s["step2"]["actor/lr"] != s["step1"]["actor/lr"]
        assert torch.equal(r["rng"], s["rng"])
        for name, tensor in s["weights"].items():
            assert torch.equal(r["weights"][name], tensor), name
    exported = run_ranks(_run, Mesh(), tiny_untied_model_path, str(tmp_path), "export")[0]
    saved = straight[0]["saved_weights"]
    assert set(exported["weights"]) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(exported["weights"][name], tensor), name


def test_mesh_names_the_fix_when_ranks_do_not_divide():
    with pytest.raises(ValueError, match=r"backend.tensor_parallel=2 x backend.pipeline_parallel=2 = 4 does not divide the 6 ranks"):
        MegatronOptions(tensor_parallel=2, pipeline_parallel=2).mesh(6)
    assert MegatronOptions(tensor_parallel=2).mesh(4) == Mesh(dp=2, tp=2)
    assert MegatronOptions(tensor_parallel=2).mesh(1) == Mesh()  # one process runs the whole model


def test_a_mixture_of_experts_model_is_refused_naming_its_type(tmp_path):
    from trellis.interfaces.backend import BackendSpec
    from trellis_demo.tasks import task_texts
    from trellis_demo.tiny import make_tiny_model
    from trellis_megatron.backend import MegatronBackend

    moe = make_tiny_model(tmp_path / "moe", task_texts(), hidden_size=32, num_layers=2, moe=True)
    with pytest.raises(
        ValueError, match=r"\(qwen3_moe\) is a mixture-of-experts model, which the megatron backend does not build.*backend.name=fsdp"
    ):
        MegatronBackend(BackendSpec("actor", str(moe), MegatronOptions(), trainable=True))
