"""LoRA adapters through PEFT: injected into the plain Hugging Face model, switched off for the
base model's forwards, merged (W + s·BA) into plain Hugging Face names for export, or saved alone
under PEFT's names.

PEFT's ``inject_adapter_in_model`` keeps the model's own class (its forward, ``_no_split_modules``
and config stay as they are); each targeted linear layer becomes a PEFT ``LoraLayer`` holding the
original as ``<name>.base_layer`` and the adapter as ``<name>.lora_A.default`` /
``<name>.lora_B.default``. Only the adapter's parameters require gradients.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

ADAPTER = "default"  # PEFT's adapter name: one adapter per model
BASE = ".base_layer"
PEFT_INIT = {"default": True, "gaussian": "gaussian"}


def add_adapter(model: torch.nn.Module, adapter, role: str, seed: int, frozen: str | None = None) -> torch.nn.Module:
    """``model`` with a LoRA adapter as the role's ``AdapterConfig`` says (initialised from
    ``seed``, whatever the global RNG holds), its base weights frozen; ``frozen``: a module (a
    frozen vision tower) the adapter leaves out."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.utils.error import NoMatchingPeftModuleError
    except ImportError as e:
        raise ImportError(
            f"config key '{role}.adapter.rank'={adapter.rank} needs peft: pip install 'trellis-backend-fsdp[lora]', or set {role}.adapter.rank=0"
        ) from e
    targets = list(adapter.target_modules)
    config = LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        init_lora_weights=PEFT_INIT[adapter.init],
        exclude_modules=_excluded(frozen),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        except (NoMatchingPeftModuleError, ValueError) as e:
            raise ValueError(
                f"config key '{role}.adapter.target_modules'={targets}: {e}; name linear layers of the model "
                f"(e.g. q_proj, v_proj) or use ['all-linear']"
            ) from e


def _excluded(frozen: str | None) -> str | None:
    """PEFT's ``exclude_modules`` (a pattern matched against whole module names) for a module and everything in it."""
    return None if frozen is None else rf"{re.escape(frozen)}(\..*)?"


def is_adapter(name: str) -> bool:
    """A parameter of the adapter (``lora_A`` / ``lora_B``), not of the base model."""
    return ".lora_A." in name or ".lora_B." in name


def hf_name(name: str) -> str:
    """The plain Hugging Face name of a base weight (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``)."""
    return name.replace(BASE + ".", ".")


def peft_name(name: str, adapted: set[str]) -> str:
    """The reverse of :func:`hf_name`: a plain name under a layer in ``adapted`` goes under its ``base_layer``."""
    module, _, leaf = name.rpartition(".")
    return f"{module}{BASE}.{leaf}" if module in adapted else name


def adapted_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Plain module name -> PEFT LoRA layer, for every layer the adapter wraps."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


@contextlib.contextmanager
def adapter_off(layers: dict[str, torch.nn.Module]) -> Iterator[None]:
    """Forwards inside the block run the base model (every LoRA layer skips its adapter)."""
    for layer in layers.values():
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers.values():
            layer.enable_adapters(True)


def merged(layer: torch.nn.Module, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``W + s·BA`` of one LoRA layer from its full ``weight`` ``(out, in)`` and adapter ``a``
    ``(rank, in)``, ``b`` ``(out, rank)``, computed in float32 and returned in ``weight``'s dtype."""
    delta = (b.float() @ a.float()) * layer.scaling[ADAPTER]
    if getattr(layer, "fan_in_fan_out", False):  # GPT-2's Conv1D stores the weight transposed
        delta = delta.T
    return (weight.float() + delta).to(weight.dtype)


def saved_name(name: str) -> str:
    """An adapter parameter under the name PEFT saves it with (``...q_proj.lora_A.default.weight``
    -> ``base_model.model...q_proj.lora_A.weight``), as ``PeftModel.from_pretrained`` reads it."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def saved_config(adapter, layers: dict[str, torch.nn.Module], base_path: str, frozen: str | None = None) -> dict:
    """``adapter_config.json``'s fields for ``adapter`` on ``layers``: the module names it wraps
    spelled out (their last parts), and the module it left out (``frozen``), so loading it adapts
    the same layers however it was targeted."""
    from peft import LoraConfig

    config = LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=sorted({name.rsplit(".", 1)[-1] for name in layers}),
        exclude_modules=_excluded(frozen),
        init_lora_weights=PEFT_INIT[adapter.init],
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base_path),
    ).to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
