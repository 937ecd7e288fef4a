"""``trellis export``: a checkpoint's policy as a Hugging Face folder that ``transformers`` loads without Trellis."""

from __future__ import annotations

from itertools import chain
from pathlib import Path

from omegaconf import OmegaConf

from trellis.checkpoint import CONFIG_FILE, read_manifest, resolve_checkpoint
from trellis.config import ConfigError
from trellis.controller import LocalController
from trellis.plugins import Plugins, load_plugins
from trellis.training import save_hf_folder, spawn_role


def export_checkpoint(where: str | Path, out_dir: str | Path, plugins: Plugins | None = None) -> Path:
    """Write the actor of checkpoint ``where`` (or of the latest complete checkpoint when ``where``
    is a run folder) to ``out_dir``: safetensors weights, config, generation config, tokenizer.
    The run's backend loads the shards on one rank; the architecture and the tokenizer come from
    the run's ``model.path`` (and ``model.tokenizer_path``)."""
    from transformers import AutoTokenizer

    path = resolve_checkpoint(where)
    if "actor" not in read_manifest(path)["roles"]:
        raise ConfigError(f"checkpoint {path} holds no actor (policy) to export")
    cfg = OmegaConf.load(path / CONFIG_FILE)
    for key in ("path", "tokenizer_path"):
        source = cfg.model.get(key)
        if source is not None and not Path(source).exists():
            raise ConfigError(
                f"checkpoint {path} was trained from model.{key}={source!r}, which no longer exists; "
                "the export takes the architecture and tokenizer from it: put the base model back there"
            )
    registry = (plugins or load_plugins()).registry
    controller = LocalController()
    try:
        policy = spawn_role(controller, registry, cfg, "ref", cfg.model.path, None, 0)  # weights only: no optimizer
        policy.load(path / "actor")
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.get("tokenizer_path") or cfg.model.path)
        return save_hf_folder(cfg.model.path, chain.from_iterable(policy.export_weights()), tokenizer, Path(out_dir))
    finally:
        controller.shutdown()
