"""A training client's model on the server: one trellis backend (one rank, in the server's process)
built from a base model's folder, full weights or a LoRA adapter, trained on Datums with Tinker's
losses and stepped with the Adam parameters each ``optim_step`` sends."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from trellis import AdapterConfig, BackendSpec, OptimConfig, save_hf_folder
from trellis_service.datums import check_datum, datum_batch, micro_batches
from trellis_service.errors import UserError
from trellis_service.losses import loss_spec, summed_loss
from trellis_service.wire import FwdBwdRequest

OUTPUT = "top_ids_log_probs"
TOKEN_BUDGET = 8192  # padded tokens per forward: bounds activation memory whatever a request holds
LORA_ALPHA = 32.0
META = "trellis_service.json"  # beside each saved state: what the model was built as


@dataclass
class ModelShape:
    """What a training client was created as: its base model (a name the server maps to a folder)
    and its LoRA adapter (``lora_rank`` 0: full fine-tuning) with the layers it adapts."""

    base_model: str
    lora_rank: int = 0
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    seed: int = 0

    def adapter(self) -> AdapterConfig | None:
        if self.lora_rank == 0:
            return None
        targets = [
            *(["q_proj", "k_proj", "v_proj", "o_proj"] if self.train_attn else []),
            *(["gate_proj", "up_proj", "down_proj"] if self.train_mlp else []),
            *(["lm_head"] if self.train_unembed else []),
        ]
        return AdapterConfig(rank=self.lora_rank, alpha=LORA_ALPHA, target_modules=targets)


class TrainedModel:
    """One training client's model. ``forward_backward`` accumulates gradients until ``optim_step``."""

    def __init__(self, model_id: str, shape: ModelShape, folder: Path, registry, backend: str) -> None:
        self.model_id, self.shape, self.folder = model_id, shape, folder
        entry = registry.get("backend", backend)
        optim = OptimConfig(lr=1e-4, betas=[0.9, 0.95], eps=1e-12, grad_clip=0.0)  # Tinker's AdamParams defaults
        spec = BackendSpec(
            "policy", str(folder), entry.options() if entry.options else None, True, optim=optim, seed=shape.seed, adapter=shape.adapter()
        )
        self.backend = entry.obj(spec)
        self.backend.build()
        self.optimizer = getattr(self.backend, "optimizer", None)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise UserError(f"backend {backend!r} keeps no torch optimizer the service can set per step; serve with --backend fsdp")
        self.registry = registry
        from transformers import AutoConfig

        self.vocab = AutoConfig.from_pretrained(folder).vocab_size
        self.steps = 0

    # -- forward and backward ------------------------------------------------------------------
    def forward_backward(self, request: FwdBwdRequest) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Each datum's target log-probs and the summed loss; with gradient unless ``forward_only``."""
        if not request.data:
            raise UserError("forward_backward: data is empty; send at least one Datum")
        spec = loss_spec(request.loss_fn, request.config)
        for i, datum in enumerate(request.data):
            check_datum(i, datum, spec, request.loss_fn, self.vocab)
        micros = micro_batches(datum_batch(request.data), TOKEN_BUDGET)
        logps: list[torch.Tensor] = []
        total = 0.0

        def loss_fn(micro, outputs):
            nonlocal total
            logp = outputs[OUTPUT][..., 0]
            logps.append(logp.detach().cpu())
            inputs = {k: micro[k].to(logp.device) for k in ("weights", "logprobs", "advantages") if k in micro}
            loss, _ = summed_loss(self.registry, request.loss_fn, request.config, logp, micro["response_mask"].to(logp.device), inputs)
            total += float(loss.detach())
            return loss, {}

        if request.forward_only:
            for micro, out in zip(micros, self.backend.forward(micros, (OUTPUT,))):
                with torch.no_grad():
                    loss_fn(micro, out)
        else:
            self.backend.forward_backward(micros, (OUTPUT,), loss_fn)
        rows = torch.cat(logps)  # (datums, width): the micro-batches keep the batch's width
        outputs = [{"logprobs": rows[i, : len(d.tokens)].numpy().astype(np.float32)} for i, d in enumerate(request.data)]
        return outputs, {"loss:sum": total}

    def optim_step(self, params) -> dict[str, float]:
        """One AdamW step with this call's ``AdamParams`` (learning rate, betas, eps, decoupled weight
        decay, gradient clipping at ``grad_clip_norm``; 0: none)."""
        for group in self.optimizer.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps, weight_decay=params.weight_decay)
        self.backend.spec.optim.grad_clip = params.grad_clip_norm
        metrics = self.backend.optimizer_step()
        self.steps += 1
        return {"grad_norm": metrics["grad_norm"], "skipped_steps": metrics["skipped_steps"], "learning_rate": params.learning_rate}

    # -- state ---------------------------------------------------------------------------------
    def save_state(self, path: Path) -> None:
        """Weights (the adapter alone for LoRA) and optimizer state, and what the model was built as."""
        path.mkdir(parents=True)
        self.backend.save(path)
        self._describe(path)

    def load_state(self, path: Path, optimizer: bool) -> None:
        """The weights saved at ``path`` and, with ``optimizer``, the optimizer's state; without it the
        optimizer starts afresh (its moments cleared)."""
        saved = read_shape(path)
        if saved != self.shape:
            raise UserError(
                f"checkpoint {path.name!r} was saved from {saved}, this client is {self.shape}; create a client from the checkpoint instead"
            )
        self.backend.load(path)
        if not optimizer:
            self.optimizer.state.clear()

    def save_for_sampler(self, path: Path, tokenizer) -> None:
        """The weights (a LoRA adapter merged into them) as a Hugging Face folder a rollout engine loads."""
        weights = (pair for bucket in self.backend.export_weights() for pair in bucket)
        save_hf_folder(str(self.folder), weights, tokenizer, path)
        self._describe(path)

    def _describe(self, path: Path) -> None:
        """Write beside a checkpoint what the model was built as (:func:`read_shape` reads it)."""
        (path / META).write_text(json.dumps({"shape": asdict(self.shape), "steps": self.steps}) + "\n")


def read_shape(path: Path) -> ModelShape:
    """What the model saved at ``path`` (training state or sampler weights) was built as."""
    meta = path / META
    if not meta.is_file():
        raise UserError(f"{path} holds no training state saved by this server (no {META}); pass a path save_state returned")
    return ModelShape(**json.loads(meta.read_text())["shape"])
