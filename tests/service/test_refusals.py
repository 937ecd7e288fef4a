"""Bad input gets a refusal naming the field, through the SDK where it can send the mistake and
over raw HTTP where it cannot (a reused ``seq_id``, a wrong key, a full queue)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from served import MODEL, TOKEN, start_server, stop_server

tinker = pytest.importorskip("tinker")
types = tinker.types


def datum(tokens, **inputs):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def post(url: str, path: str, body: dict, key: str = TOKEN) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json", "X-API-Key": key})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def retrieve(url: str, request_id: str) -> dict:
    status, answer = post(url, "/api/v1/retrieve_future", {"request_id": request_id})
    assert status == 200
    return answer


def test_unknown_base_model(service_client):
    with pytest.raises(tinker.BadRequestError, match="base_model 'nope' is not served here; served: tiny"):
        service_client.create_lora_training_client(base_model="nope", rank=4).result()


def test_lora_on_a_tied_unembedding(service_client):
    with pytest.raises(tinker.BadRequestError, match="train_unembed=False"):
        service_client.create_lora_training_client(base_model=MODEL, rank=4).result()


@pytest.mark.parametrize(
    "data, loss_fn, config, message",
    [
        (
            [datum([1, 2, 3], target_tokens=[2, 3])],
            "cross_entropy",
            None,
            r"loss_fn_inputs\['target_tokens'\] has shape \[2\], but model_input has 3 tokens",
        ),
        ([datum([1, 2], target_tokens=[2, 3], logprobs=[-1.0, -1.0], advantages=[[1.0, 1.0]])], "ppo", None, r"'advantages'\] has shape \[1, 2\]"),
        ([datum([1, 2], target_tokens=[2, 3])], "ppo", None, r"lacks \['logprobs', 'advantages'\]"),
        (
            [datum([1, 2], target_tokens=[2, 3], mask=np.ones(2, dtype=np.float32))],
            "cross_entropy",
            None,
            r"has \['mask'\], which loss_fn 'cross_entropy' does not read",
        ),
        ([datum([1, 2], target_tokens=[2, 99999])], "cross_entropy", None, "token id 99999 is outside the model's vocabulary"),
        ([datum([1, 2], target_tokens=[2, 3])], "stable_reinforce", None, "loss_fn 'stable_reinforce' is not supported by this server"),
        ([datum([1, 2], target_tokens=[2, 3], logprobs=[-1.0, -1.0], advantages=[1.0, 1.0])], "dro", None, r"needs loss_fn_config\['beta'\] > 0"),
        (
            [datum([1, 2], target_tokens=[2, 3], logprobs=[-1.0, -1.0], advantages=[1.0, 1.0])],
            "ppo",
            {"clip": 0.2},
            r"key\(s\) \['clip'\] are not read by 'ppo'",
        ),
    ],
)
def test_datums_that_do_not_fit_their_loss(service_client, data, loss_fn, config, message):
    client = service_client.create_lora_training_client(base_model=MODEL, rank=0).result()  # a failed request poisons its client
    with pytest.raises(tinker.RequestFailedError, match=message):
        client.forward_backward(data, loss_fn, config).result()


def test_sampler_path_that_does_not_exist(service_client):
    with pytest.raises(tinker.BadRequestError, match="does not exist on this server"):
        service_client.create_sampling_client(model_path="tinker://abc:train:0/sampler_weights/nope").result()
    with pytest.raises(tinker.BadRequestError, match="names training state, here sampler weights are needed"):
        service_client.create_sampling_client(model_path="tinker://abc:train:0/weights/x").result()


def test_raw_requests_out_of_order_with_a_wrong_key_and_beyond_the_queue(models, tmp_path):
    server = start_server(models, tmp_path / "root", extra=("--max-queue", "2"))
    try:
        url = server.url
        assert post(url, "/api/v1/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}, key="tml-wrong")[0] == 401
        session = post(url, "/api/v1/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})[1]["session_id"]
        created = post(url, "/api/v1/create_model", {"session_id": session, "model_seq_id": 0, "base_model": MODEL})[1]
        model_id = retrieve(url, created["request_id"])["model_id"]
        adam = {"learning_rate": 1e-3}
        first = post(url, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1, "optim_params": adam})[1]
        assert "metrics" in retrieve(url, first["request_id"])
        status, answer = post(url, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1, "optim_params": adam})
        assert status == 400 and "seq_id 1 for model" in answer["error"] and "out of order" in answer["error"] and answer["category"] == "user"
        # seq_ids 3 and 4 wait for 2, which never comes: the queue (2) is full
        assert post(url, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 3, "optim_params": adam})[0] == 200
        assert post(url, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 4, "optim_params": adam})[0] == 200
        status, answer = post(url, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 5, "optim_params": adam})
        assert status == 429 and "--max-queue" in answer["error"]
    finally:
        stop_server(server)
