"""Checkpoints through the real tinker SDK: ``save_state`` paths are immutable, a training client made
from a checkpoint on a restarted server continues exactly where the saved one was (weights and
optimizer state), and a weights-only load starts its optimizer afresh."""

from __future__ import annotations

import pytest
from served import MODEL, TOKEN, start_server, stop_server

tinker = pytest.importorskip("tinker")
types = tinker.types
DATA = [
    types.Datum(model_input=types.ModelInput.from_ints([20, 21, 22, 23]), loss_fn_inputs={"target_tokens": [21, 22, 23, 24], "weights": [1.0] * 4})
]
ADAM = types.AdamParams(learning_rate=2e-2)


def step(client) -> float:
    """One forward_backward + optim_step; the loss before the step."""
    loss = client.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"]
    client.optim_step(ADAM).result()
    return loss


def loss_now(client) -> float:
    return client.forward(DATA, "cross_entropy").result().metrics["loss:sum"]


def test_state_survives_a_server_restart(models, tmp_path):
    root = tmp_path / "root"
    first = start_server(models, root)
    try:
        service = tinker.ServiceClient(base_url=first.url, api_key=TOKEN)
        client = service.create_lora_training_client(base_model=MODEL, rank=0).result()
        step(client)
        step(client)
        saved = client.save_state("after-two").result().path
        assert saved == f"tinker://{client.model_id}/weights/after-two"
        with pytest.raises(tinker.RequestFailedError, match="immutable"):
            client.save_state("after-two").result()
        expected_loss = loss_now(client)
        step(client)
        expected_after_third = loss_now(client)
    finally:
        stop_server(first)

    second = start_server(models, root)
    try:
        service = tinker.ServiceClient(base_url=second.url, api_key=TOKEN)
        resumed = service.create_training_client_from_state_with_optimizer(saved).result()
        assert resumed.get_info().is_lora is False
        assert loss_now(resumed) == pytest.approx(expected_loss, rel=1e-6)
        step(resumed)
        assert loss_now(resumed) == pytest.approx(expected_after_third, rel=1e-5)  # Adam's moments came back too

        fresh = service.create_training_client_from_state(saved).result()  # weights only: new moments
        assert loss_now(fresh) == pytest.approx(expected_loss, rel=1e-6)
        step(fresh)
        assert loss_now(fresh) != pytest.approx(expected_after_third, rel=1e-5)

        with pytest.warns(FutureWarning):  # the SDK's older verb: load into an existing client
            fresh.load_state_with_optimizer(saved).result()
        assert loss_now(fresh) == pytest.approx(expected_loss, rel=1e-6)
        step(fresh)
        assert loss_now(fresh) == pytest.approx(expected_after_third, rel=1e-5)
        service.close("success").result()
    finally:
        stop_server(second)


def test_expired_checkpoints_are_removed(tmp_path):
    """A checkpoint saved with ttl_seconds is removed by the first sweep after it expires (the server
    sweeps at start-up and at each save); one without stays."""
    from trellis_service.checkpoints import Checkpoints

    checkpoints = Checkpoints(tmp_path)
    _, short = checkpoints.new("s:train:0", "weights", "short")
    _, kept = checkpoints.new("s:train:0", "weights", "kept")
    for folder in (short, kept):
        folder.mkdir()
    checkpoints.keep_for(short, 3600)
    checkpoints.keep_for(kept, None)
    now = __import__("time").time()
    assert checkpoints.sweep(now + 3500) == [] and short.is_dir()
    assert checkpoints.sweep(now + 3700) == [short]
    assert not short.exists() and kept.is_dir()
