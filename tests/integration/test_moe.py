"""Mixture-of-experts RL on a tiny Qwen3-MoE: the HF engine records each token's experts, the trainer
replays them (routing replay, R3) or counts where its own routing differs, the load-balancing loss
joins the actor's loss, and GRPO runs end to end on FSDP with the router figures in every step."""

from __future__ import annotations

import json
import shutil

import agent_loops
import pytest
import torch
from multiturn_runs import multi_turn_run
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from trellis.batch import Batch, position_ids
from trellis.config import ConfigError
from trellis.interfaces.hf import forward_outputs, load_hf_model
from trellis.interfaces.moe import ROUTED_EXPERTS, ROUTER_REPLAY, batch_routes, conversation_routes, generated_routes, recorded_routes, routers
from trellis.interfaces.rollout import Generation, RolloutSpec, Routes, SamplingParams
from trellis.plugins import load_plugins
from trellis.recipes.train import train
from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
from trellis_demo.tiny import make_tiny_model
from trellis_hf.engine import HFRollout, HFRolloutOptions

PROMPTS = ["1+2=", "12+34=", "7+7=", "40+13="]  # mixed prompt widths


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-moe", task_texts(), hidden_size=32, num_layers=2, seed=0, moe=True))


@pytest.fixture(scope="module")
def qwen2_moe_path(moe_path, tmp_path_factory):
    """A tiny Qwen2-MoE (a shared expert beside 4 routed ones, top 2, weights not renormalised) with the tiny MoE's tokenizer."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = AutoConfig.from_pretrained(moe_path)
    sizes = {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")}
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**sizes, **experts, norm_topk_prob=False, tie_word_embeddings=True, pad_token_id=0))
    out = tmp_path_factory.mktemp("models") / "tiny-qwen2-moe"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(moe_path).save_pretrained(out)
    return str(out)


def _prompts(tokenizer, texts=PROMPTS) -> Batch:
    ids = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    return Batch({"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"], "position_ids": position_ids(ids["attention_mask"])})


def _engine(path: str, dtype: str = "float32") -> HFRollout:
    tokenizer = AutoTokenizer.from_pretrained(path)
    return HFRollout(RolloutSpec(model_path=path, tokenizer=tokenizer, options=HFRolloutOptions(dtype=dtype, share_actor_weights=False), seed=0))


def _trainer(path: str):
    """The model as a backend loads it (``load_hf_model``: the KV cache off), in eval mode."""
    return load_hf_model(path, "lm", torch.float32).eval()


def _routes_of_forward(model, batch: Batch) -> torch.Tensor:
    """The experts a full forward (no cache) of ``batch``'s sequences routes each token to ``(batch, seq_len, layers, k)``."""
    with torch.no_grad(), recorded_routes(model) as calls:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    return generated_routes(calls, len(batch))


def _same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def test_the_hf_engine_records_the_experts_of_every_token_it_ran(moe_path):
    """Routes come back in the columns of input_ids, for the prompt and every sampled token but the
    last (which no forward ran: -1), and -1 on padding; a float32 engine's equal a full forward's."""
    engine = _engine(moe_path)
    model = _trainer(moe_path)
    assert len(routers(model)) == 2
    out = engine.generate(_prompts(engine.tokenizer), SamplingParams(n=2, max_new_tokens=6, return_routed_experts=True))
    routes = out[ROUTED_EXPERTS]
    assert routes.shape == (*out["input_ids"].shape, 2, 2) and routes.dtype == torch.int16
    known = routes[..., 0] >= 0  # (batch, seq_len, layers)
    attended = out["attention_mask"].bool()
    last = attended.long().cumsum(-1) == attended.sum(-1, keepdim=True)  # each sample's last token
    assert torch.equal(known[..., 0], attended & ~last)
    assert _same_experts(routes, _routes_of_forward(model, out))[known].all()
    plain = engine.generate(_prompts(engine.tokenizer), SamplingParams(n=2, max_new_tokens=6))
    assert ROUTED_EXPERTS not in plain  # recorded only when asked


def test_a_dense_model_returns_no_routes(tiny_model_path):
    engine = _engine(tiny_model_path)
    out = engine.generate(_prompts(engine.tokenizer), SamplingParams(max_new_tokens=3, return_routed_experts=True))
    assert ROUTED_EXPERTS not in out and out["responses"].shape[0] == len(PROMPTS)


def test_rounds_of_other_prompt_widths_merge_with_their_routes_aligned(moe_path):
    """Dynamic sampling merges rounds with Batch.cat(pad=True): the routes move with their tokens."""
    engine = _engine(moe_path)
    model = _trainer(moe_path)
    params = SamplingParams(n=2, max_new_tokens=5, return_routed_experts=True)
    rounds = [engine.generate(_prompts(engine.tokenizer, texts), params) for texts in (PROMPTS[:1], PROMPTS[1:])]
    assert rounds[0]["input_ids"].shape[1] != rounds[1]["input_ids"].shape[1]
    merged = Batch.cat(rounds, pad=True)
    routes = merged[ROUTED_EXPERTS]
    known = (routes[..., 0] >= 0) & merged["attention_mask"].bool()[..., None]
    assert known.any() and _same_experts(routes, _routes_of_forward(model, merged))[known].all()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_replaying_the_models_own_routes_changes_nothing_and_other_routes_change_the_log_probs(moe_path, qwen2_moe_path, family):
    path = moe_path if family == "qwen3_moe" else qwen2_moe_path
    engine = _engine(path)
    model = _trainer(path)
    batch = engine.generate(_prompts(engine.tokenizer), SamplingParams(n=2, max_new_tokens=6, return_routed_experts=True))
    batch[ROUTED_EXPERTS] = torch.where(batch[ROUTED_EXPERTS] >= 0, _routes_of_forward(model, batch), -1).to(torch.int16)
    with torch.no_grad():
        plain = forward_outputs(model, batch, ("log_probs",), "lm")["log_probs"]
        batch.meta[ROUTER_REPLAY] = "rollout"
        own = forward_outputs(model, batch, ("log_probs", "routing_flips"), "lm")
        known = batch[ROUTED_EXPERTS] >= 0
        batch[ROUTED_EXPERTS] = torch.where(known, (batch[ROUTED_EXPERTS] + 1) % 4, -1).to(torch.int16)
        other = forward_outputs(model, batch, ("log_probs", "routing_flips"), "lm")
    assert torch.equal(own["log_probs"], plain) and own["routing_flips"].sum() == 0
    mask = batch["response_mask"].bool()
    assert (other["log_probs"] - plain)[mask].abs().max() > 1e-3
    # every (token, layer) pair now differs from the model's own choice: the flips count them all
    pairs = (known[..., 0] & batch["attention_mask"].bool()[..., None]).sum((1, 2)).float()
    assert torch.equal(other["routing_flips"], pairs)


def test_padded_and_padding_free_forwards_replay_the_same_experts(moe_path):
    """Packing the samples changes the float32 rounding and with it some of the trainer's own routes;
    replaying the engine's, both layouts give the engine's log-probs to float rounding."""
    engine = _engine(moe_path)
    model = _trainer(moe_path)
    batch = engine.generate(_prompts(engine.tokenizer), SamplingParams(n=4, max_new_tokens=8, return_routed_experts=True))
    mask = batch["response_mask"].bool()
    batch.meta[ROUTER_REPLAY] = "rollout"
    with torch.no_grad():
        for padding_free in (False, True):
            out = forward_outputs(model, batch, ("log_probs",), "lm", padding_free=padding_free)["log_probs"]
            torch.testing.assert_close(out[mask], batch["rollout_log_probs"][mask], rtol=0, atol=1e-5)


def _near_tie(path: str, out: str, nudge: float) -> str:
    """``path``'s model with experts 2 and 3 of every router tied exactly (``nudge`` 0), or with
    expert 3's router row ``nudge`` above expert 2's along a random direction: where the two are
    next in line, rounding decides which one a token goes to."""
    model = AutoModelForCausalLM.from_pretrained(path)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in routers(model):
            router.weight[3] = router.weight[2] + nudge * torch.randn(router.weight.shape[1], generator=generator)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return out


def test_with_replay_the_trainers_log_probs_equal_the_engines_where_its_routing_differs(moe_path, tmp_path):
    """The trainer's routers tie experts 2 and 3 exactly; the engine's break the tie by 1e-6 (standing
    in for an engine whose numerics differ by rounding). Without replay the trainer routes some tokens
    to the other expert and its log-probs move; replaying the engine's experts, they equal the
    engine's to float rounding."""
    trainer_path = _near_tie(moe_path, str(tmp_path / "tied"), 0.0)
    engine = _engine(_near_tie(moe_path, str(tmp_path / "nudged"), 1e-6))
    trainer = _trainer(trainer_path)
    batch = engine.generate(_prompts(engine.tokenizer), SamplingParams(n=4, max_new_tokens=8, return_routed_experts=True))
    mask = batch["response_mask"].bool()
    gaps, flips = {}, {}
    for mode in ("measure", "rollout"):
        batch.meta[ROUTER_REPLAY] = mode
        with torch.no_grad():
            out = forward_outputs(trainer, batch, ("log_probs", "routing_flips"), "lm")
        gaps[mode] = float((out["log_probs"] - batch["rollout_log_probs"])[mask].abs().max())
        flips[mode] = float(out["routing_flips"].sum())
    assert flips["measure"] > 0 and gaps["measure"] > 1e-4
    assert gaps["rollout"] < 1e-5


def test_the_load_balancing_loss_is_the_models_own(moe_path):
    """``router_aux_loss`` equals what the model adds with ``output_router_logits`` (its
    ``aux_loss``) over the same attended tokens, padded or packed, with gradient to the routers."""
    tokenizer = AutoTokenizer.from_pretrained(moe_path)
    model = load_hf_model(moe_path, "lm", torch.float32)
    batch = _prompts(tokenizer)
    batch["responses"] = batch["input_ids"][:, -2:]
    expected = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}, output_router_logits=True).aux_loss
    for padding_free in (False, True):
        out = forward_outputs(model, batch, ("log_probs", "router_aux_loss", "router_entropy"), "lm", padding_free=padding_free)
        assert out["router_aux_loss"].shape == (len(batch),)
        torch.testing.assert_close(out["router_aux_loss"][0], expected)
        assert ((out["router_entropy"] > 0) & (out["router_entropy"] <= torch.log(torch.tensor(4.0)))).all()
        model.zero_grad()
        out["router_aux_loss"][0].backward()
        assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers(model))


@pytest.fixture(scope="module")
def copies_and_dense(moe_path, tmp_path_factory) -> tuple[str, str]:
    """Where the math allows, the MoE is a dense model: every expert the same MLP and the chosen
    experts' weights renormalised to 1, the forward is a Qwen3's with that MLP. The two folders."""
    folder = tmp_path_factory.mktemp("models")
    moe = _trainer(moe_path)
    config = moe.config
    dense_config = Qwen3Config(**{k: getattr(config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                                                  "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_parameters",
                                                                  "eos_token_id", "pad_token_id")},
                               intermediate_size=config.moe_intermediate_size)  # fmt: skip
    dense = Qwen3ForCausalLM(dense_config)
    state = {k: v for k, v in moe.state_dict().items() if ".mlp." not in k}
    with torch.no_grad():
        for i, layer in enumerate(moe.model.layers):
            experts = layer.mlp.experts
            experts.gate_up_proj.copy_(experts.gate_up_proj[:1].expand_as(experts.gate_up_proj))
            experts.down_proj.copy_(experts.down_proj[:1].expand_as(experts.down_proj))
            gate, up = experts.gate_up_proj[0].chunk(2, dim=0)
            state |= {f"model.layers.{i}.mlp.gate_proj.weight": gate, f"model.layers.{i}.mlp.up_proj.weight": up}
            state[f"model.layers.{i}.mlp.down_proj.weight"] = experts.down_proj[0]
    dense.load_state_dict(state, strict=True)
    paths = []
    for name, model in (("copies", moe), ("dense", dense)):
        model.generation_config = GenerationConfig.from_pretrained(moe_path)
        model.save_pretrained(folder / name)
        AutoTokenizer.from_pretrained(moe_path).save_pretrained(folder / name)
        paths.append(str(folder / name))
    return paths[0], paths[1]


def test_a_moe_whose_experts_are_copies_of_one_mlp_is_the_dense_model(copies_and_dense):
    copies, dense = (_trainer(path) for path in copies_and_dense)
    batch = _prompts(AutoTokenizer.from_pretrained(copies_and_dense[0]))
    batch["responses"] = batch["input_ids"][:, -3:]
    with torch.no_grad():
        a = forward_outputs(copies, batch, ("log_probs",), "lm")["log_probs"]
        b = forward_outputs(dense, batch, ("log_probs",), "lm")["log_probs"]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_grpo_on_the_copies_takes_the_dense_models_first_step(run_recipe, copies_and_dense, data_files, tmp_path):
    """Its first step: the same samples, rewards and loss as the dense model's, rewarded by the share
    of digits in a response (so that the advantages are not all 0). The gradients are not the dense
    model's: each expert gets its own tokens' share, and from the update on the two part."""
    reward = tmp_path / "digits.py"
    reward.write_text("def digits(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))\n")  # fmt: skip
    base = [
        f"data.train_path={data_files['train']}", "recipe=rl", "data.train_batch_prompts=4", "sampling.n=4", "sampling.max_new_tokens=6",
        "actor.micro_batch_samples=16", "trainer.total_steps=1", "trainer.trackers=[jsonl]", "validation.before_train=false",
        f"reward.path={reward}", "reward.name=digits",
    ]  # fmt: skip
    steps = {}
    for name, path in zip(("copies", "dense"), copies_and_dense):
        _, rows = run_recipe(tmp_path / name, [*base, f"model.path={path}"], ())
        steps[name] = next(r for r in rows if "reward/mean" in r)
    assert steps["dense"]["actor/pg_loss"] != 0 and steps["dense"]["reward/groups_with_signal"] > 0
    for key in ("reward/mean", "response/length_mean", "actor/entropy", "actor/pg_loss"):
        assert steps["copies"][key] == pytest.approx(steps["dense"][key], rel=1e-4, abs=1e-6), key


def test_a_trainers_update_is_renamed_to_the_checkpoints_names_an_engine_loads(moe_path, tiny_model_path):
    """vLLM and SGLang load checkpoint names (one tensor per expert); the trainer holds transformers'
    fused experts. ``checkpoint_names`` turns the update into exactly the checkpoint's tensors, which
    ``prepare_update`` then checks against the folder, whole or streamed with a manifest."""
    from trellis.interfaces.weights import checkpoint_names, engine_weights, prepare_update

    config = AutoConfig.from_pretrained(moe_path)
    expected, tied = engine_weights(moe_path, config)
    state = _trainer(moe_path).state_dict()
    rename = checkpoint_names(config)
    whole = prepare_update(list(state.items()), expected, tied, rename=rename)
    assert {name for name, _ in whole.manifest} == set(expected)  # the tied head completed from the embedding
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
    tensors = dict(whole.tensors)
    assert torch.equal(tensors["model.layers.1.mlp.experts.3.up_proj.weight"], gate_up[3, gate_up.shape[1] // 2 :])
    streamed = prepare_update(iter(state.items()), expected, tied, shapes={k: v.shape for k, v in state.items()}, rename=rename)
    assert streamed.manifest == whole.manifest and all(torch.equal(t, tensors[n]) for n, t in streamed.tensors)
    assert checkpoint_names(AutoConfig.from_pretrained(tiny_model_path)) is None  # a dense model's names are its checkpoint's


@pytest.fixture(scope="module")
def near_tie_path(moe_path, tmp_path_factory):
    return _near_tie(moe_path, str(tmp_path_factory.mktemp("models") / "near-tie"), 1e-4)


@pytest.mark.parametrize("mode", ["measure", "rollout"])
def test_grpo_trains_a_moe_on_fsdp_with_a_bf16_engine_and_reports_its_routing(run_recipe, near_tie_path, data_files, tmp_path, mode):
    """GRPO on FSDP beside a bfloat16 HF engine: rounding routes some tokens to other experts than
    the float32 trainer would (moe/routing_flip_rate > 0); the load-balancing loss trains with it."""
    base = [
        "recipe=rl", f"model.path={near_tie_path}", f"data.train_path={data_files['train']}", "data.train_batch_prompts=4",
        "sampling.n=4", "sampling.max_new_tokens=6", "actor.micro_batch_samples=8", "actor.optim.lr=1e-3", "trainer.total_steps=2",
        "trainer.trackers=[jsonl]", "rollout.dtype=bfloat16", "rollout.share_actor_weights=false", "sync_check.max_gap=100",
        "validation.before_train=false",
    ]  # fmt: skip
    _, rows = run_recipe(tmp_path / mode, base, (f"actor.router_replay={mode}", "actor.router_aux_loss_coef=0.01"))
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert 0 < row["moe/routing_flip_rate"] < 0.5
        assert 1.0 <= row["moe/load_max/layer0"] <= 4.0 and 0 < row["moe/router_entropy"] <= 1.3863
        assert row["actor/router_aux_loss"] > 0


def test_one_step_ahead_runs_carry_their_routes(run_rl_moe):
    rows = run_rl_moe("actor.router_replay=rollout", "trainer.async_mode=one_step")
    assert all("moe/routing_flip_rate" in r for r in rows if "reward/mean" in r)


def test_steps_made_ahead_keep_their_routes_through_a_checkpoint(run_rl_moe, tmp_path):
    """The exact schedule checkpoints the steps generated ahead; resumed from checkpoint 1, step 2
    trains on the saved samples, routes included (without them it would stop naming the engine)."""
    ahead = ("actor.router_replay=rollout", "trainer.async_mode=fully_async", "trainer.max_staleness=1", "trainer.save_every_steps=1")
    first = run_rl_moe(*ahead)
    shutil.rmtree(tmp_path / "run" / "checkpoint-2")
    again = run_rl_moe(*ahead)
    step2 = [r for r in again if r.get("step") == 2 and "reward/mean" in r]  # the log is cut back to the checkpoint's step
    assert len(step2) == 1 and step2[0]["moe/routing_flip_rate"] == 0.0  # a float32 engine on the trainer's weights
    before = next(r for r in first if r.get("step") == 2 and "reward/mean" in r)
    assert {k: step2[0][k] for k in ("reward/mean", "actor/pg_loss")} == {k: before[k] for k in ("reward/mean", "actor/pg_loss")}


@pytest.fixture
def run_rl_moe(run_recipe, moe_path, data_files, tmp_path):
    def run(*overrides: str):
        base = [
            "recipe=rl", f"model.path={moe_path}", f"data.train_path={data_files['train']}", "data.train_batch_prompts=4",
            "sampling.n=4", "sampling.max_new_tokens=6", "actor.micro_batch_samples=8", "trainer.total_steps=2",
            "trainer.trackers=[jsonl]", "validation.before_train=false",
        ]  # fmt: skip
        return run_recipe(tmp_path / "run", base, overrides)[1]

    return run


def test_conversations_replay_the_routes_of_every_turn(moe_path, tmp_path):
    """Multi-turn samples (an interaction answers each model turn) of prompts of other widths: each
    conversation's routes come from its turns, in the batch's columns, and the trainer replaying them
    gives the engine's log-probs (sync/batch_gap)."""
    rows = make_arithmetic_split(8, 0, split="train", max_value=30, interaction="answer")
    for i, row in enumerate(rows):
        row["prompt"][0]["content"] *= 1 + i % 3
    train_file = write_rows(rows, tmp_path / "widths.parquet")
    interaction = "multi_turn.interactions=[{name: answer, component: contains_answer}]"
    more = ("multi_turn.max_response_tokens=32", "multi_turn.max_user_turns=2", interaction, "actor.router_replay=rollout")
    plugins = load_plugins(extra=[("agent_loops", agent_loops)])
    train(None, multi_turn_run(_ending_early(moe_path, tmp_path / "model"), train_file, tmp_path / "run", *more), plugins=plugins)
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in r]
    assert len(steps) == 2 and max(r["multiturn/num_turns_mean"] for r in steps) > 1
    assert all(r["moe/routing_flip_rate"] < 0.01 and r["sync/batch_gap"] < 1e-5 for r in steps)


def _ending_early(path: str, out) -> str:
    """``path``'s model with 60 more end-of-sequence ids in its generation config: a random model's
    turns then end in a few tokens (a stop, not the length limit), so the interaction asks again."""
    shutil.copytree(path, out)
    config = json.loads((out / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], *range(100, 160)]
    (out / "generation_config.json").write_text(json.dumps(config))
    return str(out)


def test_conversation_routes_take_each_position_from_the_first_turn_that_ran_it():
    first = Routes([1, 2, 3], torch.tensor([[[0, 1]], [[1, 2]], [[2, 3]]], dtype=torch.int16))
    rerun = Routes([1, 2, 3, 4, 5, 6], torch.tensor([[[3, 0]]] * 6, dtype=torch.int16))  # re-ran the prefix, then 3 new tokens
    elsewhere = Routes([9, 9, 9, 9, 9, 9, 9, 9], torch.zeros(8, 1, 2, dtype=torch.int16))  # a re-rendered context: not this one's prefix
    turns = [Generation([3, 4], [0.0, 0.0], "stop", first), Generation([6], [0.0], "stop", rerun), Generation([], [], "stop", elsewhere)]
    routes = conversation_routes([1, 2, 3, 4, 5, 6, 7, 8], turns)
    assert routes[:, 0].tolist() == [[0, 1], [1, 2], [2, 3], [3, 0], [3, 0], [3, 0], [-1, -1], [-1, -1]]
    laid = batch_routes([routes[:5], None], [2, 2], prompt_width=4, width=3)
    assert laid.shape == (2, 7, 1, 2) and laid[0, :2].eq(-1).all() and laid[0, 2:, 0].tolist() == routes[:5, 0].tolist()
    assert laid[1].eq(-1).all()


def test_replay_with_partial_rollouts_is_refused_by_name(run_rl_moe):
    with pytest.raises(ConfigError, match="actor.router_replay.*partial rollout"):
        run_rl_moe("actor.router_replay=measure", "trainer.async_mode=fully_async", "trainer.partial_rollout=true")


@pytest.mark.parametrize("key", ["actor.router_replay=rollout", "actor.router_aux_loss_coef=0.01"])
def test_moe_settings_on_a_dense_model_are_refused_naming_the_key(run_rl, key):
    with pytest.raises(ConfigError, match=f"'{key.split('=')[0]}'.*no experts"):
        run_rl(key)


def test_an_activation_checkpoints_recomputation_replays_the_same_experts(moe_path):
    """The backward recomputes a checkpointed layer's forward after forward_outputs returned: the
    routers stay armed, so its gradients are those of the replayed forward."""
    engine = _engine(moe_path)
    batch = engine.generate(_prompts(engine.tokenizer), SamplingParams(n=2, max_new_tokens=6, return_routed_experts=True))
    known = batch[ROUTED_EXPERTS] >= 0
    batch[ROUTED_EXPERTS] = torch.where(known, (batch[ROUTED_EXPERTS] + 1) % 4, -1).to(torch.int16)  # not the model's own choice
    batch.meta[ROUTER_REPLAY] = "rollout"
    grads = []
    for checkpointing in (False, True):
        model = load_hf_model(moe_path, "lm", torch.float32).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        forward_outputs(model, batch, ("log_probs",), "lm")["log_probs"].sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0])
