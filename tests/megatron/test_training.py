"""Training through core's role worker: one actor update on the Megatron backend equals the FSDP
backend's on the same batch (every metric, the gradient norm, the updated weights) at TP=1, TP=2
and DP=2; forwards at PP=2 equal PP=1; the critic trains."""

from __future__ import annotations

from itertools import chain

import pytest
import torch
from omegaconf import OmegaConf
from ranks import run_ranks

from trellis.batch import Batch
from trellis.config import validate
from trellis.interfaces.dispatch import DP_SPLIT, Mesh
from trellis.plugins import load_plugins
from trellis.runtime.worker import build_worker
from trellis_algos import ActorConfig, CriticConfig
from trellis_fsdp.backend import FSDPOptions
from trellis_megatron.options import MegatronOptions

PROMPT, RESPONSE, SAMPLES = 5, 6, 8


def rl_batch(vocab: int, seed: int = 0) -> Batch:
    """8 samples: left-padded prompts, right-padded responses of varied length, random
    advantages, old log-probs and returns."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(2, PROMPT + 1, (SAMPLES,), generator=g)
    resp_len = torch.randint(1, RESPONSE + 1, (SAMPLES,), generator=g)
    prompt_mask = (torch.arange(PROMPT) >= PROMPT - prompt_len[:, None]).long()
    response_mask = (torch.arange(RESPONSE) < resp_len[:, None]).long()
    responses = torch.randint(3, vocab, (SAMPLES, RESPONSE), generator=g) * response_mask
    mask = torch.cat([prompt_mask, response_mask], 1)
    return Batch(
        {
            "input_ids": torch.cat([torch.randint(3, vocab, (SAMPLES, PROMPT), generator=g) * prompt_mask, responses], 1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": response_mask,
            "advantages": torch.randn(SAMPLES, 1, generator=g).expand(SAMPLES, RESPONSE) * response_mask,
            # near the model's own log-probs of random tokens, so the ratio is clipped sometimes
            "old_log_probs": (-5.6 + 0.3 * torch.randn(SAMPLES, RESPONSE, generator=g)) * response_mask,
            "returns": torch.randn(SAMPLES, RESPONSE, generator=g) * response_mask,
            "values": torch.randn(SAMPLES, RESPONSE, generator=g) * response_mask,
        },
        meta={"temperature": 0.7, "step": 1},
    )


# Adam's first step moves each weight by lr * g / (|g| + eps). With the default eps (1e-8) a
# weight whose gradient is near 1e-8 (a few dozen of the embedding's) turns a 1e-10 rounding
# difference between two reduction orders into an lr-sized step of either sign. eps = lr = 1e-3
# makes the step smooth in g: equal weights to 1e-5 then mean equal gradients to about 1e-5.
LR = EPS = 1e-3


def role_options(registry, role: str):
    if role == "critic":
        return validate(OmegaConf.create({"micro_batch_samples": 2, "optim": {"lr": LR, "eps": EPS, "grad_clip": 1.0}}), CriticConfig, registry)
    base = {"micro_batch_samples": 2, "optim": {"lr": LR, "eps": EPS, "grad_clip": 1.0}, "policy_loss": {"name": "vanilla"}, "entropy_coeff": 0.01}
    return validate(OmegaConf.create(base), ActorConfig, registry)


def _update(info, backend: str, path: str, role: str, tp: int, pp: int):
    """One ``update`` on this rank's share of the batch; the metrics and the full weights after it."""
    registry = load_plugins().registry
    # float32 on both sides, so the comparison holds on a GPU too (where each defaults to bfloat16 compute)
    options = MegatronOptions(tensor_parallel=tp, pipeline_parallel=pp, dtype="float32") if backend == "megatron" else FSDPOptions(param_dtype=None)
    objectives = {"update": "policy" if role == "actor" else "value"}
    head = "value" if role == "critic" else "lm"
    worker = build_worker(registry, backend, role, path, role_options(registry, role), objectives, options=options, dist=info, head=head)
    batch = rl_batch(worker.backend.hf_config.vocab_size if backend == "megatron" else worker.backend.model.config.vocab_size)
    mine = DP_SPLIT.scatter((batch,), info.mesh)[info.rank][0]
    metrics = worker.train("update", mine)
    weights = dict(chain.from_iterable(worker.export_weights(all_ranks=True)))
    return {"metrics": metrics, "weights": weights}


@pytest.fixture(scope="module")
def fsdp_actor(tiny_untied_model_path):
    """FSDP's update on 1 and on 2 data-parallel ranks (averaged metrics depend on how samples
    are dealt into micro-batches, so DP=2 is compared with DP=2)."""
    runs = {dp: run_ranks(_update, Mesh(dp=dp), "fsdp", tiny_untied_model_path, "actor", 1, 1) for dp in (1, 2)}
    return {dp: {"metrics": DP_SPLIT.gather([r["metrics"] for r in rs], Mesh(dp=dp)), "weights": rs[0]["weights"]} for dp, rs in runs.items()}


@pytest.mark.parametrize("mesh", [Mesh(tp=1), Mesh(tp=2), Mesh(dp=2)], ids=["tp1", "tp2", "dp2"])
def test_actor_update_equals_fsdp(mesh, fsdp_actor, tiny_untied_model_path):
    results = run_ranks(_update, mesh, "megatron", tiny_untied_model_path, "actor", mesh.tp, 1)
    fsdp_actor = fsdp_actor[mesh.dp]
    want = fsdp_actor["metrics"]
    got = DP_SPLIT.gather([r["metrics"] for r in results], mesh)  # what a controller returns
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-5, rel=1e-5), key
    for r in results:
        for name, tensor in fsdp_actor["weights"].items():
            torch.testing.assert_close(r["weights"][name], tensor, atol=1e-5, rtol=0, msg=name)
    assert want["actor/grad_norm"] > 1.0  # the clip to 1.0 was exercised
    name = "model.layers.0.mlp.down_proj.weight"
    moved = fsdp_actor["weights"][name] - initial_weight(tiny_untied_model_path, name)
    assert moved.abs().max() > 0.3 * LR  # the update moved the weights


def initial_weight(path: str, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")[name]


def _forwards(info, path: str, tp: int, pp: int):
    """The actor's log-probs, entropy and sum of squared probabilities, then the same after one
    update (the gradients crossed the pipeline stages), at the given layout."""
    registry = load_plugins().registry
    options = MegatronOptions(tensor_parallel=tp, pipeline_parallel=pp)
    worker = build_worker(registry, "megatron", "actor", path, role_options(registry, "actor"), {"update": "policy"}, options=options, dist=info)
    batch = rl_batch(worker.backend.hf_config.vocab_size)
    before = worker.log_prob(batch, with_entropy=True, with_sum_sq_probs=True)
    metrics = worker.train("update", batch)
    after = worker.log_prob(batch, with_entropy=True)
    exported = [(name, tuple(t.shape)) for name, t in chain.from_iterable(worker.export_weights(all_ranks=True))]
    shapes = worker.weight_shapes()
    return {"before": before, "after": after, "metrics": metrics, "collects": info.mesh.collects(info.rank), "shapes": shapes, "exported": exported}


@pytest.mark.parametrize("model", ["tiny_untied_model_path", "tiny_model_path"], ids=["untied", "tied"])
def test_pipeline_parallel_equals_one_stage(model, request):
    """PP=2 (one decoder layer per stage) against PP=1: forwards, an update, forwards after it.
    Tied: the embedding (first stage) and the LM head (last stage) are one weight whose gradient
    is summed over the two stages."""
    path = request.getfixturevalue(model)
    want = run_ranks(_forwards, Mesh(), path, 1, 1)[0]
    results = run_ranks(_forwards, Mesh(pp=2), path, 1, 2)
    assert [r["collects"] for r in results] == [False, True]  # the last stage's results are collected
    for r in results:  # every stage returns the last stage's results
        for key in ("log_probs", "entropy", "sum_sq_probs"):
            torch.testing.assert_close(r["before"][key], want["before"][key], atol=1e-5, rtol=0)
        for key in ("log_probs", "entropy"):
            torch.testing.assert_close(r["after"][key], want["after"][key], atol=1e-5, rtol=0)
        for key, value in want["metrics"].items():
            assert r["metrics"][key] == pytest.approx(value, abs=1e-5, rel=1e-5), key
        # every stage exports (and announces) every tensor, in the one-stage order
        assert r["exported"] == want["exported"] == list(r["shapes"].items())
    mask = rl_batch(10)["response_mask"].bool()
    assert (want["after"]["log_probs"] - want["before"]["log_probs"])[mask].abs().max() > 1e-4  # the update changed the model


def _critic(info, path: str, tp: int):
    """An FSDP critic's weights (value head included) loaded into a Megatron critic at ``tp``,
    then one update of each on the same batch, on separate process groups in one process."""
    from transformers import AutoConfig

    registry = load_plugins().registry
    batch = rl_batch(AutoConfig.from_pretrained(path).vocab_size)
    results = {}
    for backend in ("fsdp", "megatron"):
        options = MegatronOptions(tensor_parallel=tp) if backend == "megatron" else None
        worker = build_worker(
            registry, backend, "critic", path, role_options(registry, "critic"), {"update": "value"}, options=options, dist=info, head="value"
        )
        if backend == "fsdp":
            # cloned: on one rank FSDP's full state dict shares storage with the live parameters
            initial = {k: v.clone() for k, v in chain.from_iterable(worker.export_weights(all_ranks=True))}
        else:
            worker.load_weights(initial.items())
        values = worker.values(batch)["values"]
        metrics = worker.train("update", batch)
        results[backend] = {"values": values, "metrics": metrics, "weights": dict(chain.from_iterable(worker.export_weights(all_ranks=True)))}
    return results


@pytest.mark.parametrize("tp", [1, 2])
def test_critic_equals_fsdp(tp, tiny_model_path):
    for r in run_ranks(_critic, Mesh(tp=tp), tiny_model_path, tp):
        fsdp, megatron = r["fsdp"], r["megatron"]
        # positions past a response's end differ (padding queries; nothing reads them there)
        mask = rl_batch(10)["response_mask"].bool()
        torch.testing.assert_close(megatron["values"][mask], fsdp["values"][mask], atol=1e-5, rtol=0)
        assert set(megatron["metrics"]) == set(fsdp["metrics"])
        for key, value in fsdp["metrics"].items():
            # vf_clip_frac counts `clipped_loss > plain_loss`, where an unclipped prediction
            # makes the two equal up to rounding (old + (v - old) vs v): a tie decided by noise
            if key == "critic/vf_clip_frac":
                continue
            assert megatron["metrics"][key] == pytest.approx(value, abs=1e-5, rel=1e-5), key
        assert set(megatron["weights"]) == set(fsdp["weights"])
        for name, tensor in fsdp["weights"].items():
            torch.testing.assert_close(megatron["weights"][name], tensor, atol=1e-5, rtol=0, msg=name)
