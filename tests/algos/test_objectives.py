"""The objectives (kind ``objective``) against their formulas written out by hand: what each
training verb's loss is, from forward outputs, with the global counts of the mini-batch."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from trellis.batch import Batch
from trellis.config import validate
from trellis.interfaces.signatures import Aggregation, pair_batch
from trellis.plugins import load_plugins
from trellis_algos import ActorConfig, CriticConfig, PreferenceTrainConfig, SFTTrainConfig

B, R = 4, 3


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


def make(registry, name, schema, **options):
    return registry.get("objective", name).obj(validate(OmegaConf.create(options), schema, registry), registry)


def rl_micro() -> Batch:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    return Batch(
        {
            "responses": torch.ones(B, R, dtype=torch.long),
            "response_mask": mask,
            "old_log_probs": -torch.rand(B, R, generator=g),
            "advantages": torch.randn(B, 1, generator=g).expand(B, R) * mask,
            "ref_log_probs": -torch.rand(B, R, generator=g),
            "returns": torch.randn(B, R, generator=g),
            "values": torch.randn(B, R, generator=g),
        }
    )


def test_policy_objective_is_pg_minus_entropy_plus_kl(registry):
    """reinforce's loss is -A·logp; with token-mean over 9 tokens in a mini-batch of 2x this micro-batch
    (global_tokens=18) the micro-batch's share is half its own token mean."""
    objective = make(registry, "policy", ActorConfig, policy_loss={"name": "reinforce"}, use_kl_loss=True, kl_loss_type="k1",
                     kl_loss_coef=0.5, entropy_coeff=0.1)  # fmt: skip
    micro = rl_micro()
    assert objective.outputs == ("log_probs", "entropy")
    assert {"old_log_probs", "advantages", "ref_log_probs"} <= set(objective.inputs)
    log_probs = -torch.rand(B, R, generator=torch.Generator().manual_seed(1))
    entropy = torch.rand(B, R, generator=torch.Generator().manual_seed(2))
    mask = micro["response_mask"].float()
    local = objective.counts(micro)
    assert (local.global_tokens, local.global_seqs) == (9.0, 4.0)
    agg = Aggregation("token-mean", global_tokens=18.0, global_seqs=8.0)
    loss, metrics = objective.loss(micro, {"log_probs": log_probs, "entropy": entropy}, agg)
    pg = (-micro["advantages"] * log_probs * mask).sum() / 18
    ent = (entropy * mask).sum() / 18
    kl = ((log_probs - micro["ref_log_probs"]) * mask).sum() / 18
    assert float(loss) == pytest.approx(float(pg - 0.1 * ent + 0.5 * kl), abs=1e-6)
    assert metrics["entropy_loss"] == pytest.approx(float(ent), abs=1e-6) and metrics["kl_loss"] == pytest.approx(float(kl), abs=1e-6)
    assert objective.summed >= {"pg_loss", "entropy_loss", "kl_loss"}


def test_value_objective_is_half_the_clipped_squared_error(registry):
    objective = make(registry, "value", CriticConfig, cliprange_value=0.2)
    micro = rl_micro()
    vpreds = micro["values"] + torch.tensor([0.5, -0.1, 0.0, 0.3])[:, None]
    loss, metrics = objective.loss(micro, {"values": vpreds}, Aggregation("token-mean", global_tokens=9.0))
    clipped = micro["values"] + (vpreds - micro["values"]).clamp(-0.2, 0.2)
    per_token = torch.maximum((vpreds - micro["returns"]) ** 2, (clipped - micro["returns"]) ** 2)
    assert float(loss) == pytest.approx(0.5 * float((per_token * micro["response_mask"]).sum()) / 9, abs=1e-6)
    assert metrics["vf_loss"] == pytest.approx(float(loss))


def test_sft_objective_counts_label_tokens_after_the_first(registry):
    objective = make(registry, "sft", SFTTrainConfig)
    loss_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]])
    micro = Batch({"input_ids": torch.zeros(2, 4, dtype=torch.long), "loss_mask": loss_mask})
    assert objective.counts(micro).global_tokens == 4.0  # labels are input_ids[:, 1:]
    label_lp = torch.log(torch.tensor([[0.5, 0.5, 0.25], [0.5, 0.125, 0.5]]))
    loss, _ = objective.loss(micro, {"label_log_probs": label_lp}, Aggregation("token-mean", global_tokens=4.0))
    assert float(loss) == pytest.approx((math.log(2) + math.log(4) + math.log(8) + math.log(2)) / 4, abs=1e-6)


def test_preference_objective_forwards_chosen_then_rejected_and_takes_its_share(registry):
    objective = make(registry, "preference", PreferenceTrainConfig, loss={"name": "sigmoid", "beta": 0.5})
    rows_of = {k: torch.ones(2, 3, dtype=torch.long) for k in ("input_ids", "attention_mask", "position_ids")}
    chosen = Batch({**rows_of, "responses": torch.ones(2, 2, dtype=torch.long), "response_mask": torch.tensor([[1, 1], [1, 0]])})
    rejected = Batch({**rows_of, "responses": torch.ones(2, 3, dtype=torch.long), "response_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])})
    pairs = pair_batch(chosen, rejected, torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))
    rows = objective.rows(pairs)
    assert len(rows) == 4 and rows["response_mask"].shape == (4, 3)  # padded to the longer side
    log_probs = torch.tensor([[-0.5, -0.5, 0.0], [-1.0, -9.0, -9.0], [-1.0, -1.0, -1.0], [-0.5, -9.0, -9.0]])
    loss, metrics = objective.loss(rows, {"log_probs": log_probs}, Aggregation(global_seqs=4.0))  # 2 of the mini-batch's 4 pairs
    margins = torch.tensor([(-1.0 - -1.0) - (-3.0 - -1.5), (-1.0 - -2.0) - (-0.5 - -1.0)])  # (chosen - ref) - (rejected - ref)
    expected = -torch.nn.functional.logsigmoid(0.5 * margins).mean() * 2 / 4
    assert float(loss) == pytest.approx(float(expected), abs=1e-6) and metrics["loss"] == pytest.approx(float(expected), abs=1e-6)


def test_preference_pairs_whose_sides_differ_in_prompt_width_keep_each_response_last(registry):
    """SPIN's pairs: each side in the rollout layout, padded to its own widths (the data's answer
    beside a generated one); chosen then rejected rows must keep every response in the last columns."""
    from rollouts import rollout_round

    from trellis_algos.rl.invariants import check_alignment

    objective = make(registry, "preference", PreferenceTrainConfig, loss={"name": "sigmoid", "beta": 0.5})
    chosen = rollout_round([[1, 2, 3], [4]], [[11, 12], [13]])
    rejected = rollout_round([[1], [4, 5]], [[21, 22, 23, 24], [25, 26]])
    rows = objective.rows(pair_batch(chosen, rejected, torch.zeros(2), torch.zeros(2)))
    check_alignment(rows, step=1)
    kept = [r[m.bool()].tolist() for r, m in zip(rows["input_ids"], rows["attention_mask"])]
    assert kept == [[1, 2, 3, 11, 12], [4, 13], [1, 21, 22, 23, 24], [4, 5, 25, 26]]


def test_bradley_terry_objective_by_hand_on_three_pairs(registry):
    from trellis_algos.rm import RMTrainConfig

    objective = make(registry, "bradley_terry", RMTrainConfig)
    sides = {
        f"{side}_{k}": torch.tensor([[5, 6, 7], [5, 6, 0], [5, 0, 0]]) if k == "input_ids" else mask
        for side, mask in (("chosen", torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])), ("rejected", torch.tensor([[1, 1, 0], [1, 0, 0], [1, 0, 0]])))
        for k in ("input_ids", "attention_mask", "position_ids")
    }
    pairs = Batch({**sides, "margin": torch.tensor([0.0, 1.0, 0.0])})
    rows = objective.rows(pairs)
    assert len(rows) == 6 and torch.equal(rows["margin"], torch.tensor([0.0, 1.0, 0.0] * 2))  # chosen rows, then rejected rows
    assert torch.equal(rows["attention_mask"][3:], pairs["rejected_attention_mask"])
    scores = torch.tensor([2.0, 0.5, -1.0, 1.0, 1.0, 0.0])  # r_chosen = 2, 0.5, -1; r_rejected = 1, 1, 0
    loss, metrics = objective.loss(rows, {"scores": scores}, Aggregation(global_seqs=6.0))  # 3 of the mini-batch's 6 pairs
    # -log sigmoid(x) = log(1 + e^-x) for d - margin = 1, -1.5, -1
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1.5)) + math.log(1 + math.exp(1))) / 6
    assert float(loss) == pytest.approx(expected, abs=1e-6) and metrics["loss"] == pytest.approx(expected, abs=1e-6)
    assert metrics["accuracy"] == pytest.approx(1 / 6)  # one pair of the 6 has r_chosen > r_rejected
    assert metrics["margin"] == pytest.approx((1.0 - 0.5 - 1.0) / 6)
