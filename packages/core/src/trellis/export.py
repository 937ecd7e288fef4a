"""``trellis export``: a checkpoint's policy as a Hugging Face folder that ``transformers`` loads without Trellis."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterable
from itertools import chain
from pathlib import Path

import torch
from omegaconf import OmegaConf

from trellis.config import ConfigError
from trellis.outdir import check_replaceable
from trellis.plugins import Plugins, load_plugins
from trellis.runtime.checkpoint import CONFIG_FILE, read_manifest, resolve_checkpoint
from trellis.runtime.controller import LocalController
from trellis.runtime.harness import spawn_worker

MARKER_FILE = "trellis_export.json"  # in every folder save_hf_folder writes: only such a folder is replaced


def export_checkpoint(where: str | Path, out_dir: str | Path, plugins: Plugins | None = None) -> Path:
    """Write the actor of checkpoint ``where`` (or of the latest complete checkpoint when ``where``
    is a run folder) to ``out_dir``: safetensors weights, config, generation config, tokenizer.
    The run's backend loads the shards on one rank; the architecture and the tokenizer come from
    the run's ``model.path`` (and ``model.tokenizer_path``). ``out_dir`` must lie outside the run
    folder and be absent, empty or an earlier export (else ``FileExistsError``)."""
    from transformers import AutoTokenizer

    path = resolve_checkpoint(where)
    run_dir, target = path.parent.resolve(), Path(out_dir).resolve()
    if target == run_dir or run_dir in target.parents or target in run_dir.parents:
        raise FileExistsError(
            f"trellis export: {str(out_dir)!r} is the run folder {str(run_dir)!r}, inside it or above it; an export never writes "
            f"there: give a folder outside the run, e.g. {str(run_dir.with_name(run_dir.name + '-hf'))!r}"
        )
    check_replaceable(Path(out_dir), MARKER_FILE, "trellis export")
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
        # no objectives: weights only, no optimizer; the actor's section brings its adapter (merged on export)
        policy = spawn_worker(controller, registry, cfg, "actor", cfg.model.path, cfg.get("actor"))
        policy.load(path / "actor")
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.get("tokenizer_path") or cfg.model.path)
        return save_hf_folder(cfg.model.path, chain.from_iterable(policy.export_weights()), tokenizer, Path(out_dir))
    finally:
        controller.shutdown()


def save_hf_folder(config_source: str, weights: Iterable[tuple[str, torch.Tensor]], tokenizer: object, out_dir: Path) -> Path:
    """Write a Hugging Face folder: the architecture of ``config_source`` with ``weights``.
    Written to a temporary folder and renamed, so a crash never leaves half a model; a folder
    already at ``out_dir`` is replaced only when an earlier call wrote it."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    check_replaceable(out_dir, MARKER_FILE, "trellis export")
    config = AutoConfig.from_pretrained(config_source)
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(dict(weights), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"exported weights do not fit {config_source}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with contextlib.suppress(OSError):
        GenerationConfig.from_pretrained(config_source).save_pretrained(tmp)
    (tmp / MARKER_FILE).write_text(json.dumps({"written_by": "trellis", "architecture_from": str(config_source)}) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
