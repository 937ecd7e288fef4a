"""When a Ray run may go into a loopback-only network namespace, and what it says when it cannot."""

from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from trellis_ray import network


def config(**trainer):
    base = {"controller": "ray", "ray_network": "private", "nnodes": 1, "trackers": ["jsonl"]}
    return OmegaConf.create({"reward": {"name": "auto", "options": {}}, "trainer": {**base, **trainer}})


def test_a_url_anywhere_in_the_config_needs_the_network_and_is_named():
    cfg = config()
    cfg.reward.options = {"judges": [{"url": "http://127.0.0.1:9000/v1"}]}
    assert network.needs_network(cfg) == "config key 'reward.options.judges[0].url' names a network endpoint (http://127.0.0.1:9000/v1)"
    assert network.needs_network(config()) is None


def test_online_trackers_need_the_network(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert "wandb tracker logs online" in network.needs_network(config(trackers=["wandb"]))
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert network.needs_network(config(trackers=["wandb"])) is None


@pytest.mark.parametrize(
    ("trainer", "env", "said"),
    [
        ({"ray_network": "host"}, {}, None),
        ({}, {"RAY_ADDRESS": "10.0.0.1:6379"}, "it joins the cluster at RAY_ADDRESS"),
        ({"nnodes": 2}, {}, "trainer.nnodes=2 needs the network"),
    ],
)
def test_runs_that_stay_on_the_host_network(trainer, env, said, monkeypatch, caplog):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with caplog.at_level(logging.INFO, logger="trellis"):
        assert network.relaunch_command(config(**trainer), ["train", "x.yaml"]) is None
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ray:")]
    if said is None:
        assert lines == []
    else:
        assert len(lines) == 1 and said in lines[0] and "token auth" in lines[0] and "trainer.ray_network=host" in lines[0]


def test_a_private_run_relaunches_under_unshare(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(network, "_no_user_namespaces", lambda: None)
    command = network.relaunch_command(config(), ["train", "x.yaml", "trainer.controller=ray"])
    assert command[:4] == network.UNSHARE and command[-5:] == ["-m", "trellis.cli", "train", "x.yaml", "trainer.controller=ray"]
    monkeypatch.setenv(network.INSIDE, "1")
    assert network.relaunch_command(config(), ["train", "x.yaml"]) is None  # the relaunched process runs the run
