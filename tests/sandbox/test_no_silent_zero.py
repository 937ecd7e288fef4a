"""A sandbox that cannot run a sample's code never scores it 0 in silence: the sample is a reward
error (``reward/errors``), a batch of them stops the run above ``reward.max_error_rate``, and a
missing or unreachable server stops ``trellis train --dry-run`` before any model is built."""

from __future__ import annotations

import socket

import pytest
import torch
from test_rl_code_task import code_rows

pytest.importorskip("trellis_fsdp", reason="the rl recipe's check needs trellis-algos and a backend installed")

from trellis.batch import Batch  # noqa: E402
from trellis.config import ConfigError  # noqa: E402
from trellis.plugins import load_plugins  # noqa: E402
from trellis.recipes.train import train  # noqa: E402
from trellis.rewards import RewardError
from trellis_algos.rewards import RewardConfig, RewardManager
from trellis_demo.tasks import write_rows  # noqa: E402
from trellis_sandbox.reward import compute_score  # noqa: E402

GOOD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def closed_port_url() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_an_unreachable_sandbox_raises_instead_of_scoring_zero():
    url = closed_port_url()
    with pytest.raises(RuntimeError, match=rf"the sandbox did not run 2 of 2 cases: cannot reach the sandbox at {url}"):
        compute_score("code_sum", GOOD, code_rows(1)[0]["reward_model"]["ground_truth"], None, url=url)


def test_a_batch_the_sandbox_cannot_score_stops_at_the_default_error_rate(tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = tokenizer(GOOD, add_special_tokens=False)["input_ids"]
    rows = code_rows(4)
    batch = Batch(
        {"responses": torch.tensor([ids] * 4), "response_mask": torch.ones(4, len(ids), dtype=torch.long)},
        {"data_source": [r["data_source"] for r in rows], "ground_truth": [r["reward_model"]["ground_truth"] for r in rows]},
    )
    manager = RewardManager(RewardConfig(name="sandbox_fusion", kwargs={"url": closed_port_url()}), load_plugins().registry, tokenizer)
    with pytest.raises(RewardError, match=r"failed on 4 of 4 samples \(100%\), above reward.max_error_rate=0.1"):
        manager.score(batch)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ([], r"config key 'reward': reward 'sandbox_fusion' is not ready: reward sandbox_fusion needs the server's address: set reward.kwargs.url"),
        (["reward.kwargs.url=CLOSED"], r"reward 'sandbox_fusion' is not ready: cannot reach the sandbox at CLOSED.*trellis-sandbox serve"),
    ],
)
def test_dry_run_checks_the_sandbox_before_building_anything(kwargs, message, tiny_model_path, tmp_path):
    url = closed_port_url()
    data = write_rows(code_rows(4), tmp_path / "code.jsonl")
    args = [
        "recipe=rl",
        f"model.path={tiny_model_path}",
        f"data.train_path={data}",
        "reward.name=sandbox_fusion",
        f"trainer.run_dir={tmp_path / 'run'}",
        *[k.replace("CLOSED", url) for k in kwargs],
    ]
    with pytest.raises(ConfigError, match=message.replace("CLOSED", url)):
        train(None, args, dry_run=True)
    assert not (tmp_path / "run").exists()
