"""The FSDP2 backend driven by core's role worker on a tiny model: parity with an unsharded model
(1 and 2 gloo ranks) and with the tests-only plain backend, log-probs, weight export and load,
critic, reward model, SFT and preference steps."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
from itertools import chain

import pytest
import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from trellis.batch import Batch
from trellis.config import validate
from trellis.interfaces.backend import DistInfo
from trellis.interfaces.signatures import PolicyLossInputs, aggregation_for, pair_batch
from trellis.plugins import load_plugins
from trellis.runtime.worker import RoleWorker, WorkerSpec
from trellis_algos import ActorConfig, CriticConfig, PreferenceTrainConfig, SFTTrainConfig
from trellis_algos.policy_losses import VanillaOptions, vanilla
from trellis_fsdp.backend import FSDPBackend, FSDPOptions
from trellis_plain import PlainBackend

# role -> the objectives its training verbs use
OBJECTIVES = {"actor": {"update": "policy"}, "critic": {"update": "value"}, "sft": {"sft_update": "sft"}}


def end_rank() -> None:
    """Ends a spawned gloo rank once its results are saved: all ranks meet, leave the group and exit
    at once. Left to the interpreter's teardown, the rank's live sharded model drops its last hold
    on the gloo group there, which aborted about 1 run in 20 ("terminate called without an active
    exception", no Python frame): a crash of the test scaffolding after the work was done."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A free port on loopback for the 2-rank tests' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_worker(registry, path, role, role_options=None, objectives=None, dist=None, backend=FSDPBackend, total_steps=0, head="lm", **opts):
    """A built role worker on ``backend`` (FSDP unless said otherwise)."""
    options = FSDPOptions(**opts) if backend is FSDPBackend else None
    spec = WorkerSpec(role, path, backend, options, role_options, objectives or {}, dist or DistInfo(), registry, total_steps=total_steps, head=head)
    worker = RoleWorker(spec)
    worker.build()
    return worker


LR = 1e-2
# AdamW's first step moves a weight by lr * g / (|g| + eps): with torch's eps (1e-8) a gradient of
# summation-order noise (~1e-8 here: the micro-batches sum in another order than the whole batch)
# moves it by up to lr, and on an AVX2 CPU one weight of 4096 landed 4e-5 apart; this eps keeps such
# noise at 1e-2 * lr while a real gradient (>= 1e-4) still moves its weight by lr
ADAM_EPS = 1e-6
PROMPT, RESPONSE, SAMPLES = 5, 6, 8


def rl_batch(vocab: int, seed: int = 0, response_lengths: torch.Tensor | None = None, temperature: float = 0.7) -> Batch:
    """SAMPLES samples: left-padded prompts, right-padded responses (of ``response_lengths``, else
    random), random advantages; widths PROMPT and RESPONSE."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(2, PROMPT + 1, (SAMPLES,), generator=g)
    resp_len = torch.randint(1, RESPONSE + 1, (SAMPLES,), generator=g) if response_lengths is None else response_lengths
    prompt_mask = (torch.arange(PROMPT) >= PROMPT - prompt_len[:, None]).long()
    response_mask = (torch.arange(RESPONSE) < resp_len[:, None]).long()
    prompts = torch.randint(3, vocab, (SAMPLES, PROMPT), generator=g) * prompt_mask
    responses = torch.randint(3, vocab, (SAMPLES, RESPONSE), generator=g) * response_mask
    mask = torch.cat([prompt_mask, response_mask], 1)
    return Batch(
        {
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": response_mask,
            "advantages": torch.randn(SAMPLES, 1, generator=g).expand(SAMPLES, RESPONSE) * response_mask,
        },
        meta={"temperature": temperature},
    )


def reference_log_probs(model, batch: Batch) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
    logits = logits[:, -RESPONSE - 1 : -1].float() / batch.meta["temperature"]
    # log softmax at the token, written as the backends compute it (the k_proj biases get a
    # gradient of pure rounding noise, which AdamW scales up to lr: the same formula keeps it equal)
    return logits.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


def actor_options(registry, **overrides):
    base = {"micro_batch_samples": 2, "optim": {"lr": LR, "grad_clip": 1.0}, "policy_loss": {"name": "vanilla"}}
    return validate(OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(overrides)), ActorConfig, registry)


def reference_step(path: str, batch: Batch):
    """The same PPO step done by hand on the unsharded model: loss over the whole batch, clip, AdamW."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    log_prob = reference_log_probs(model, batch)
    data = PolicyLossInputs(log_prob, batch["old_log_probs"], batch["advantages"], batch["response_mask"])
    loss, _ = vanilla(data, aggregation_for("token-mean", batch["response_mask"]), VanillaOptions())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=ADAM_EPS).step()
    return float(loss.detach()), float(norm), {k: v.detach().clone() for k, v in model.state_dict().items()}


def prepared_batch(path: str) -> Batch:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = rl_batch(model.config.vocab_size)
    with torch.no_grad():
        lp = reference_log_probs(model, batch)
    # old log-probs slightly off the current ones, so the ratio and clipping are exercised
    batch["old_log_probs"] = lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1)) * batch["response_mask"]
    return batch


def _rank_main(rank: int, world: int, port: int, path: str, batch: Batch, out: str) -> None:
    torch.set_num_threads(1)
    registry = load_plugins().registry
    options = actor_options(registry, optim={"lr": LR, "grad_clip": 1.0, "eps": ADAM_EPS})
    worker = make_worker(registry, path, "actor", options, OBJECTIVES["actor"], DistInfo(rank, world, master_port=port))
    metrics = worker.train("update", batch.chunk(world)[rank])
    weights = dict(b for bucket in worker.export_weights() for b in bucket)
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights}, out)
    end_rank()


@pytest.mark.parametrize("world", [1, 2])
def test_update_matches_unsharded_model(tiny_model_path, tmp_path, world):
    batch = prepared_batch(tiny_model_path)
    ref_loss, ref_norm, ref_weights = reference_step(tiny_model_path, batch)
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(_rank_main, args=(world, free_port(), tiny_model_path, batch, out), nprocs=world, start_method="spawn")
    result = torch.load(out)
    assert result["metrics"]["actor/pg_loss"] == pytest.approx(ref_loss, abs=1e-5)
    assert result["metrics"]["actor/grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    assert set(result["weights"]) == set(ref_weights)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(result["weights"][name], ref, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


def build(registry, path, role, role_options=None, objectives=None, **opts):
    return make_worker(registry, path, role, role_options, objectives, **opts)


def test_log_prob_entropy_and_sum_sq_probs_match_unsharded_forward(registry, tiny_model_path):
    batch = prepared_batch(tiny_model_path)
    ref = build(registry, tiny_model_path, "ref")
    out = ref.log_prob(batch, with_entropy=True, with_sum_sq_probs=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        expected = reference_log_probs(model, batch)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
        probs = torch.softmax(logits[:, -RESPONSE - 1 : -1].float() / batch.meta["temperature"], -1)
    # response positions as the unsharded forward gives them; 0 at padding
    pad = batch["response_mask"] == 0
    torch.testing.assert_close(out["log_probs"], expected.masked_fill(pad, 0), atol=1e-5, rtol=0)
    torch.testing.assert_close(out["sum_sq_probs"], probs.pow(2).sum(-1).masked_fill(pad, 0), atol=1e-6, rtol=0)
    # entropy of a distribution over V tokens lies in [0, log V]
    assert out["entropy"].shape == (SAMPLES, RESPONSE)
    assert (out["entropy"] >= 0).all() and (out["entropy"] <= torch.log(torch.tensor(float(model.config.vocab_size)))).all()


def test_dynamic_batching_gives_same_log_probs(registry, tiny_model_path):
    batch = prepared_batch(tiny_model_path)
    by_samples = build(registry, tiny_model_path, "actor", actor_options(registry)).log_prob(batch)
    by_tokens = build(registry, tiny_model_path, "actor", actor_options(registry, max_tokens_per_micro_batch=20)).log_prob(batch)
    torch.testing.assert_close(by_tokens["log_probs"], by_samples["log_probs"], atol=1e-6, rtol=0)


def test_export_weights_in_buckets_with_hf_names(registry, tiny_untied_model_path):
    worker = build(registry, tiny_untied_model_path, "actor", actor_options(registry))
    buckets = list(worker.export_weights(bucket_bytes=4096))
    assert len(buckets) > 1
    model = AutoModelForCausalLM.from_pretrained(tiny_untied_model_path, dtype=torch.float32)
    exported = dict(b for bucket in buckets for b in bucket)
    assert set(exported) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(exported[name], tensor), name


def test_critic_learns_returns(registry, tiny_model_path):
    opts = validate(OmegaConf.create({"micro_batch_samples": 4, "optim": {"lr": 3e-3}, "cliprange_value": 100.0}), CriticConfig, registry)
    critic = build(registry, tiny_model_path, "critic", opts, OBJECTIVES["critic"], head="value")
    batch = prepared_batch(tiny_model_path)
    batch["returns"] = torch.full((SAMPLES, RESPONSE), 2.0) * batch["response_mask"]
    losses = []
    for _ in range(15):
        batch["values"] = critic.values(batch)["values"]
        losses.append(critic.train("update", batch)["critic/vf_loss"])
    assert losses[-1] < 0.2 * losses[0], losses


def test_reward_model_scores_last_token(registry, tiny_model_path):
    rm = build(registry, tiny_model_path, "reward_model", head="value")
    batch = prepared_batch(tiny_model_path)
    scores = rm.score(batch)["scores"]
    assert scores.shape == (SAMPLES,)
    # the score is the head's output at the last valid token: tokens after it (padding) change nothing
    changed = Batch({k: v.clone() for k, v in batch.tensors.items()})
    padding = changed["attention_mask"] == 0
    assert padding[:, PROMPT:].any(), "the batch must have right padding for this test to mean anything"
    changed["input_ids"][padding] = 5
    torch.testing.assert_close(rm.score(changed)["scores"], scores)
    # and it moves when the last valid token changes
    last = batch["attention_mask"].cumsum(-1).argmax(-1)
    changed["input_ids"][torch.arange(SAMPLES), last] = (changed["input_ids"][torch.arange(SAMPLES), last] + 1) % 20 + 3
    assert not torch.allclose(rm.score(changed)["scores"], scores)


def test_sft_steps_lower_the_loss(registry, tiny_model_path, tmp_path):
    opts = validate(OmegaConf.create({"micro_batch_samples": 4, "optim": {"lr": 1e-2}}), SFTTrainConfig, registry)
    worker = build(registry, tiny_model_path, "actor", opts, OBJECTIVES["sft"])
    batch = prepared_batch(tiny_model_path)
    batch["loss_mask"] = torch.cat([torch.zeros(SAMPLES, PROMPT, dtype=torch.long), batch["response_mask"]], 1)
    first = worker.evaluate("sft_update", batch)["val/loss"]
    for _ in range(10):
        worker.train("sft_update", batch)
    assert worker.evaluate("sft_update", batch)["val/loss"] < 0.5 * first
    (tmp_path / "ok.json").write_text(json.dumps(first))


def _save_main(rank: int, world: int, port: int, path: str, batch: Batch, out: str) -> None:
    torch.set_num_threads(1)
    registry = load_plugins().registry
    options = actor_options(registry, optim={"lr": LR, "grad_clip": 1.0, "eps": ADAM_EPS})
    worker = make_worker(registry, path, "actor", options, OBJECTIVES["actor"], DistInfo(rank, world, master_port=port))
    worker.train("update", batch.chunk(world)[rank])
    worker.log_prob(batch)  # a no_grad forward just before saving (leaves the root unsharded)
    worker.save(f"{out}/ckpt")
    weights = dict(b for bucket in worker.export_weights() for b in bucket)
    if rank == 0:
        torch.save(weights, f"{out}/weights.pt")
    end_rank()


def test_checkpoint_resumes_training_exactly(registry, tiny_model_path, tmp_path):
    """Two steps in a row equal one step, save, load into a fresh worker, one step: same loss, weights, LR."""
    batch = prepared_batch(tiny_model_path)
    opts = actor_options(registry, optim={"lr": LR, "lr_schedule": "cosine", "warmup_steps": 1}, shuffle=True, mini_batch_samples=4)
    straight = make_worker(registry, tiny_model_path, "actor", opts, OBJECTIVES["actor"], total_steps=4)
    straight.train("update", batch)
    straight.log_prob(batch)
    straight.save(tmp_path / "ckpt")
    expected = straight.train("update", batch)
    resumed = make_worker(registry, tiny_model_path, "actor", opts, OBJECTIVES["actor"], total_steps=4)
    resumed.log_prob(batch)  # the pitfall: a no_grad forward before loading
    resumed.load(tmp_path / "ckpt")
    assert resumed.train("update", batch) == expected  # same loss, grad norm and LR to the last bit
    for (name, a), (_, b) in zip(*(chain.from_iterable(w.export_weights()) for w in (straight, resumed))):
        assert torch.equal(a, b), name


def test_checkpoint_written_by_two_ranks_loads_on_one(registry, tiny_model_path, tmp_path):
    batch = prepared_batch(tiny_model_path)
    mp.start_processes(_save_main, args=(2, free_port(), tiny_model_path, batch, str(tmp_path)), nprocs=2, start_method="spawn")
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} >= {".metadata", "__0_0.distcp", "__1_0.distcp", "rank0.pt", "rank1.pt"}
    ref = build(registry, tiny_model_path, "ref")  # no optimizer: loads the weights alone
    ref.load(tmp_path / "ckpt")
    saved = torch.load(tmp_path / "weights.pt")
    for name, tensor in chain.from_iterable(ref.export_weights()):
        assert torch.equal(tensor, saved[name]), name


@pytest.mark.parametrize("opts", [{"activation_checkpointing": True}, {"param_dtype": "bfloat16", "reduce_dtype": "float32"}])
def test_checkpointing_and_mixed_precision_update_like_fp32(registry, tiny_model_path, opts):
    """Activation checkpointing recomputes the same forward (same result to fp32 precision);
    bf16 compute stays close to the fp32 update (loose tolerance: bf16 has 8 bits of mantissa)."""
    batch = prepared_batch(tiny_model_path)
    plain = build(registry, tiny_model_path, "actor", actor_options(registry), OBJECTIVES["actor"]).train("update", batch)
    other = build(registry, tiny_model_path, "actor", actor_options(registry), OBJECTIVES["actor"], **opts).train("update", batch)
    tol = 1e-5 if "activation_checkpointing" in opts else 5e-2
    assert other["actor/pg_loss"] == pytest.approx(plain["actor/pg_loss"], abs=tol)
    assert other["actor/grad_norm"] == pytest.approx(plain["actor/grad_norm"], rel=tol * 10)


def test_other_architecture_loads_and_trains(registry, tiny_model_path, tmp_path):
    """Nothing is tied to Qwen2: a Llama folder shards (its own decoder-layer class; one rank
    shards when it casts, here to bfloat16 compute) and trains."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    batch = prepared_batch(str(tmp_path / "llama"))
    worker = build(registry, str(tmp_path / "llama"), "actor", actor_options(registry), OBJECTIVES["actor"], param_dtype="bfloat16")
    sharded = [type(m).__name__ for m in worker.backend.model.modules() if type(m).__name__.startswith("FSDP")]
    assert "FSDPLlamaDecoderLayer" in sharded and "FSDPLlamaForCausalLM" in sharded
    metrics = worker.train("update", batch)
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0


@pytest.mark.parametrize("role", ["actor", "sft"])
def test_plain_backend_trains_exactly_like_fsdp_on_one_rank(registry, tiny_model_path, role):
    """The tests-only plain backend has no loss code: the same objective through either backend
    gives the same loss, grad norm and updated weights."""
    batch = prepared_batch(tiny_model_path)
    if role == "sft":
        batch["loss_mask"] = torch.cat([torch.zeros(SAMPLES, PROMPT, dtype=torch.long), batch["response_mask"]], 1)
        opts = validate(OmegaConf.create({"micro_batch_samples": 4, "optim": {"lr": LR}}), SFTTrainConfig, registry)
        step, loss_key = (lambda w: w.train("sft_update", batch)), "sft/loss"
    else:
        opts = actor_options(registry, entropy_coeff=0.01)
        step, loss_key = (lambda w: w.train("update", batch)), "actor/pg_loss"
    objectives = OBJECTIVES[role]
    fsdp, plain = (make_worker(registry, tiny_model_path, "actor", opts, objectives, backend=b) for b in (FSDPBackend, PlainBackend))
    got, expected = step(plain), step(fsdp)
    assert set(got) == set(expected)
    assert got[loss_key] == pytest.approx(expected[loss_key], abs=1e-6)
    assert got[f"{loss_key.split('/')[0]}/grad_norm"] == pytest.approx(expected[f"{loss_key.split('/')[0]}/grad_norm"], abs=1e-6)
    for (name, a), (_, b) in zip(*(chain.from_iterable(w.export_weights()) for w in (plain, fsdp))):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_ref_takes_the_actors_weights_in_memory(registry, tiny_model_path):
    batch = prepared_batch(tiny_model_path)
    actor = build(registry, tiny_model_path, "actor", actor_options(registry), OBJECTIVES["actor"])
    ref = build(registry, tiny_model_path, "ref")
    actor.train("update", batch)
    before = ref.log_prob(batch)["log_probs"]
    assert not torch.allclose(before, actor.log_prob(batch)["log_probs"], atol=1e-4)  # the update moved the actor
    ref.load_weights(chain.from_iterable(actor.export_weights()))
    torch.testing.assert_close(ref.log_prob(batch)["log_probs"], actor.log_prob(batch)["log_probs"], atol=1e-6, rtol=0)


def preference_pairs(path: str, registry) -> tuple[Batch, Batch]:
    """4 pairs (chosen = rows 0-3, rejected = rows 4-7 of the RL batch) with the reference's summed
    log-probs, which start equal to the policy's."""
    batch = prepared_batch(path)
    ref = build(registry, path, "ref")
    seq = (ref.log_prob(batch)["log_probs"] * batch["response_mask"]).sum(-1)
    return pair_batch(batch[torch.arange(4)], batch[torch.arange(4, 8)], seq[:4], seq[4:]), seq


def test_preference_step_starts_at_log2_and_raises_the_margin(registry, tiny_model_path):
    """DPO with policy == reference: every margin is 0, the loss is -log sigmoid(0) = log 2 whatever
    the micro-batching; a step on it makes chosen more likely than rejected."""
    pairs, ref_seq = preference_pairs(tiny_model_path, registry)
    losses = []
    for micro in (1, 4):
        opts = validate(OmegaConf.create({"micro_batch_samples": micro, "optim": {"lr": 1e-2}}), PreferenceTrainConfig, registry)
        worker = build(registry, tiny_model_path, "actor", opts, {"preference_update": "preference"})
        metrics = worker.train("preference_update", pairs)
        losses.append(metrics["actor/loss"])
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6) and losses[1] == pytest.approx(math.log(2), abs=1e-6)
    seq = (worker.log_prob(prepared_batch(tiny_model_path))["log_probs"] * prepared_batch(tiny_model_path)["response_mask"]).sum(-1)
    margin = (seq[:4] - ref_seq[:4]) - (seq[4:] - ref_seq[4:])
    assert (margin > 0).all(), margin


def test_log_probs_take_only_the_response_positions_through_the_lm_head(tiny_model_path):
    """forward_outputs asks the model for the last response_len + 1 positions only; the log-probs
    and entropies equal those sliced from the logits of every position."""
    from trellis.interfaces.hf import forward_outputs, lm_outputs

    batch = prepared_batch(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        kept = forward_outputs(model, batch, ("log_probs", "entropy"), "lm")
        everything = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
        sliced = lm_outputs(everything, batch, ("log_probs", "entropy"))
    assert everything.shape[1] == PROMPT + RESPONSE
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(kept[key], sliced[key], atol=1e-6, rtol=0)


def test_numeric_options_declare_and_enforce_ranges(registry, assert_ranges_enforced):
    assert assert_ranges_enforced(FSDPOptions, registry) == 1


def test_string_options_declare_and_enforce_their_values(registry, assert_choices_enforced):
    assert assert_choices_enforced(FSDPOptions, registry) == 5  # dtype, param_dtype, reduce_dtype, optimizer, share_prompts
