"""Fixtures for core tests: a plugin distribution that fails to import, made on the fly."""

from __future__ import annotations

import textwrap

import pytest


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
