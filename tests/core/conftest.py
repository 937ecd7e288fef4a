"""Fixtures for core tests: a plugin distribution that fails to import, made on the fly; and
``trellis train`` of a one-row rl config with one override, as a user would type it."""

from __future__ import annotations

import textwrap

import pytest
from cli_runs import run_cli


@pytest.fixture
def broken_vllm_plugin(tmp_path, monkeypatch):
    """A distribution ``trellis-rollout-vllm`` on sys.path whose plugin module cannot import
    (its engine is missing), found through a real entry point in a real dist-info folder."""
    site = tmp_path / "site"
    info = site / "trellis_rollout_vllm-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trellis-rollout-vllm\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[trellis]\nvllm = fake_trellis_vllm.plugin\n")
    pkg = site / "fake_trellis_vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "plugin.py").write_text(
        textwrap.dedent("""
        import vllm_engine_that_is_not_installed  # noqa: F401
    """)
    )
    monkeypatch.syspath_prepend(str(site))
    return site


@pytest.fixture
def train_with(tmp_path, tiny_model_path):
    """``train_with(override)``: ``trellis train run.yaml <override>`` (in this process,
    ``cli_runs``), on a one-row rl config in ``tmp_path``; returns its exit status and output."""

    def run(override: str):
        data = tmp_path / "train.jsonl"
        data.write_text('{"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}\n')
        config = tmp_path / "run.yaml"
        config.write_text(f"recipe: rl\nmodel: {{path: {tiny_model_path}}}\ndata: {{train_path: {data}}}\n")
        return run_cli("train", str(config), override, cwd=tmp_path)

    return run
