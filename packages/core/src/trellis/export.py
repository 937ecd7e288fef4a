"""``trellis export``: a checkpoint's policy (or reward model) as a Hugging Face folder that
``transformers`` loads without Trellis, or a policy's LoRA adapter alone as a folder ``peft`` loads
onto the base model."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterable
from itertools import chain
from pathlib import Path

import torch
from omegaconf import OmegaConf

from trellis.config import ConfigError
from trellis.interfaces.hf import causal_lm_class
from trellis.outdir import check_replaceable
from trellis.plugins import Plugins, load_plugins
from trellis.registry import RegistryError
from trellis.runtime.checkpoint import CONFIG_FILE, adapter_base_mismatch, read_manifest, resolve_checkpoint
from trellis.runtime.controller import LocalController
from trellis.runtime.harness import policy_section, spawn_worker

MARKER_FILE = "trellis_export.json"  # in every folder save_hf_folder writes: only such a folder is replaced
# what a vision-language model's folder holds beside its weights for its images, copied into an export
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def export_checkpoint(where: str | Path, out_dir: str | Path, plugins: Plugins | None = None, adapter_only: bool = False) -> Path:
    """Write the actor of checkpoint ``where`` (or of the latest complete checkpoint when ``where``
    is a run folder) to ``out_dir``: safetensors weights, config, generation config, tokenizer;
    a checkpoint of the ``rm`` recipe holds a ``reward_model`` instead, written as a
    sequence-classification folder.
    The run's backend loads the shards on one rank; the architecture and the tokenizer come from
    the run's ``model.path`` (and ``model.tokenizer_path``). ``out_dir`` must lie outside the run
    folder and be absent, empty or an earlier export (else ``FileExistsError``).
    ``adapter_only``: a run that trained a LoRA adapter writes the adapter alone, as PEFT saves one
    (``adapter_config.json``, ``adapter_model.safetensors``), plus the tokenizer."""
    from transformers import AutoTokenizer

    path = resolve_checkpoint(where)
    run_dir, target = path.parent.resolve(), Path(out_dir).resolve()
    if target == run_dir or run_dir in target.parents or target in run_dir.parents:
        raise FileExistsError(
            f"trellis export: {str(out_dir)!r} is the run folder {str(run_dir)!r}, inside it or above it; an export never writes "
            f"there: give a folder outside the run, e.g. {str(run_dir.with_name(run_dir.name + '-hf'))!r}"
        )
    check_replaceable(Path(out_dir), MARKER_FILE, "trellis export")
    manifest = read_manifest(path)
    roles = manifest["roles"]
    cfg = OmegaConf.load(path / CONFIG_FILE)
    registry = (plugins or load_plugins()).registry
    try:
        exports = registry.get("recipe", cfg.recipe).declared["exports"]  # the roles the recipe's checkpoints export
    except RegistryError as exc:
        raise ConfigError(f"checkpoint {path} was written by recipe {cfg.recipe!r}: {exc}") from None
    role = next((r for r in exports if r in roles), None)
    if role is None:
        wanted = " or ".join(exports) or "role (the recipe declares no exports)"
        raise ConfigError(f"checkpoint {path} of recipe {cfg.recipe!r} holds no {wanted} to export (its roles: {', '.join(roles)})")
    section = policy_section(cfg, registry) if role == "actor" else None  # the policy's section brings its adapter
    adapter = section.get("adapter") if section is not None else None
    if adapter_only and not (adapter and adapter.rank > 0):
        raise ConfigError(
            f"trellis export --adapter-only: the {role} of checkpoint {path} trains full weights: there is no adapter to export alone; "
            "export the merged model (without --adapter-only)"
        )
    trained_in = Path(manifest.get("cwd", "."))
    for key in ("path", "tokenizer_path"):
        source = cfg.model.get(key)
        if source is not None and not Path(source).exists() and (trained_in / source).exists():
            cfg.model[key] = source = str(trained_in / source)  # relative to the folder the run was started in
        if source is not None and not Path(source).exists():
            raise ConfigError(
                f"checkpoint {path} was trained from model.{key}={source!r}, which no longer exists; "
                "the export takes the architecture and tokenizer from it: put the base model back there"
            )
    mismatch = adapter_base_mismatch(path, cfg.model.path)
    if mismatch:
        raise ConfigError(
            f"trellis export: {mismatch}; an adapter fits only its own base, which the export reads from the run's model.path: "
            "put that model back there"
        )
    controller = LocalController()
    try:
        # no objectives: weights only, no optimizer; the adapter is merged unless adapter_only
        head = exports[role]
        model = spawn_worker(controller, registry, cfg, role, cfg.model.path, section, head=head)
        model.load(path / role)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.get("tokenizer_path") or cfg.model.path)
        if adapter_only:
            config, tensors = model.export_adapter()
            return save_adapter_folder(config, tensors, tokenizer, Path(out_dir))
        return save_hf_folder(cfg.model.path, chain.from_iterable(model.export_weights()), tokenizer, Path(out_dir), head)
    finally:
        controller.shutdown()


def save_hf_folder(config_source: str, weights: Iterable[tuple[str, torch.Tensor]], tokenizer: object, out_dir: Path, head: str = "lm") -> Path:
    """Write a Hugging Face folder: the architecture of ``config_source`` with ``weights``, as a
    causal LM (``head="lm"``) or, for a role with the ``reward`` head, a one-label
    ``AutoModelForSequenceClassification`` whose ``pad_token_id`` is the tokenizer's (transformers
    reads each sequence's score at its last token that is not padding). Written to a temporary
    folder and renamed, so a crash never leaves half a model; a folder already at ``out_dir`` is
    replaced only when an earlier call wrote it."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, GenerationConfig

    check_replaceable(out_dir, MARKER_FILE, "trellis export")
    if head == "reward":
        config = AutoConfig.from_pretrained(config_source, num_labels=1, pad_token_id=tokenizer.pad_token_id)
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        config = AutoConfig.from_pretrained(config_source)
        model = causal_lm_class(config_source).from_config(config)
    missing, unexpected = model.load_state_dict(dict(weights), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings and head == "lm")]
    if missing or unexpected:
        raise RuntimeError(f"exported weights do not fit {config_source}: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if head == "lm":
            with contextlib.suppress(OSError):
                GenerationConfig.from_pretrained(config_source).save_pretrained(tmp)
            for name in PROCESSOR_FILES:  # a vision-language model's image processor
                if (Path(config_source) / name).is_file():
                    shutil.copy2(Path(config_source) / name, tmp / name)

    return _write_folder(out_dir, write, tokenizer, {"architecture_from": str(config_source)})


def save_adapter_folder(config: dict, tensors: dict[str, torch.Tensor], tokenizer: object, out_dir: Path) -> Path:
    """Write a PEFT adapter folder (``PeftModel.from_pretrained(base, out_dir)`` loads it onto the
    base model ``config["base_model_name_or_path"]``), atomically like :func:`save_hf_folder`."""
    from safetensors.torch import save_file

    check_replaceable(out_dir, MARKER_FILE, "trellis export")

    def write(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp / "adapter_model.safetensors"))

    return _write_folder(out_dir, write, tokenizer, {"adapter_of": config["base_model_name_or_path"]})


def _killed_writes(out_dir: Path) -> list[Path]:
    """The temporary folders beside ``out_dir`` that an earlier write of it made (exactly the name
    :func:`_write_folder` gives: ``.<out>.tmp-<pid>-<8 hex digits>``) and whose process is gone."""
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.tmp-(\d+)-[0-9a-f]{{8}}")
    killed = []
    for folder in out_dir.parent.iterdir():
        found = pattern.fullmatch(folder.name)
        if found is None or not folder.is_dir() or folder.is_symlink():
            continue
        try:
            os.kill(int(found[1]), 0)
        except ProcessLookupError:
            killed.append(folder)
        except PermissionError:  # another user's process: alive
            pass
    return killed


def _write_folder(out_dir: Path, write, tokenizer: object, marker: dict[str, str]) -> Path:
    """``write(tmp)`` fills a fresh temporary folder beside ``out_dir`` (made here, so removing it
    after a failure deletes nothing but this call's files), the tokenizer and the marker join it,
    then it replaces ``out_dir`` in one rename, so a crash never leaves half an export. A temporary
    folder of a write that was killed (its process gone) is removed first."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in _killed_writes(out_dir):  # nothing else would ever remove them
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()  # never one that exists; the umask's permissions, as the export will have
    try:
        write(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER_FILE).write_text(json.dumps({"written_by": "trellis", **marker}) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
