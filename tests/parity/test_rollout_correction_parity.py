"""Rollout correction (decoupled: old vs rollout log-probs) against verl 0.9.1's
``rollout_corr_helper``: weights, rejection mask and the shared metrics."""

from __future__ import annotations

import pytest
import torch
from parity_inputs import TOL

from trellis_algos.rollout_correction import RolloutCorrectionOptions, rollout_correction

helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper", reason="the parity tests need verl==0.9.1 (nox -s parity)")

IS = [
    ({"rollout_is": "token", "rollout_is_threshold": 1.2}, {"rollout_is": "token", "rollout_is_threshold": 1.2}),
    ({"rollout_is": "sequence", "rollout_is_threshold": 1.5}, {"rollout_is": "sequence", "rollout_is_threshold": 1.5}),
    (
        {"rollout_is": "token", "rollout_is_threshold": 1.2, "rollout_is_threshold_lower": 0.9},
        {"rollout_is": "token", "rollout_is_threshold": "0.9_1.2"},
    ),
    ({"rollout_is": "token", "rollout_is_batch_normalize": True}, {"rollout_is": "token", "rollout_is_batch_normalize": True}),
    ({"rollout_is": "sequence", "rollout_is_batch_normalize": True}, {"rollout_is": "sequence", "rollout_is_batch_normalize": True}),
]
RS = [("token_k1,seq_max_k2", "0.8_1.25,0.05"), ("seq_sum_k3,seq_mean_k1", "0.1,1.1"), ("token_k2,seq_mean_k3", "0.02")]
# (trellis options, verl keyword arguments): the same keys for rejection
SETTINGS = IS + [({"rollout_rs": rs, "rollout_rs_threshold": th},) * 2 for rs, th in RS]
SHARED_METRICS = {
    "is_mean": "rollout_is_mean",
    "rs_masked_fraction": "rollout_rs_masked_fraction",
    "kl": "kl",
    "k3_kl": "k3_kl",
    "chi2_token": "chi2_token",
}


@pytest.mark.parametrize(("ours_opts", "verl_kwargs"), SETTINGS)
def test_rollout_correction_matches_verl(ours_opts, verl_kwargs, case):
    old, rollout, mask = case.old_log_prob, case.rollout_log_prob, case.mask
    weights, kept, metrics = rollout_correction(old, rollout, mask, RolloutCorrectionOptions(**ours_opts))
    verl_weights, verl_mask, verl_metrics = helper.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, **{"rollout_is": None, **verl_kwargs}
    )
    if verl_weights is None:
        assert weights is None
    else:
        torch.testing.assert_close(weights, verl_weights.batch["rollout_is_weights"], **TOL)
    assert torch.equal(kept, verl_mask.to(kept.dtype))
    if "rollout_rs" in ours_opts:
        assert metrics["rollout_corr/rs_masked_fraction"] > 0  # the thresholds do reject here
    for ours_key, verl_key in SHARED_METRICS.items():
        if f"rollout_corr/{verl_key}" in verl_metrics:
            assert metrics[f"rollout_corr/{ours_key}"] == pytest.approx(verl_metrics[f"rollout_corr/{verl_key}"], abs=1e-5)
