"""Megatron-Core backend: a ``GPTModel`` from a Hugging Face folder, tensor/pipeline/data parallel,
for the actor, ref and critic roles.

Only the model: build, forwards and backwards through Megatron's ``forward_backward_func`` over
the micro-batches, its DDP and optimizer, checkpoints through Megatron's distributed
checkpointing, and HF-named weights in and out. Losses come from the objective layer through
``trellis.runtime.worker.RoleWorker`` as ``loss_fn``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from safetensors import safe_open
from transformers import AutoConfig

from trellis import Batch
from trellis.kit.backend import (
    Backend,
    BackendSpec,
    LossFn,
    WeightBucket,
    device_for,
    expert_counts,
    get_rng_state,
    leave_process_group,
    lr_factor,
    set_rng_state,
    weight_buckets,
)
from trellis_megatron.bridge import build_gpt, export_hf, hf_shapes, load_hf, make_bridge
from trellis_megatron.distributed import all_reduce_sum, init_parallel
from trellis_megatron.options import DTYPES, MegatronOptions
from trellis_megatron.outputs import role_outputs

# Megatron's fused kernels on the local layer spec. Softmax, gradient accumulation, RoPE and
# persistent layer norm need Apex or Transformer Engine (absent here): their plain PyTorch paths.
# SwiGLU and bias-dropout-add are PyTorch functions Megatron compiles (torch.compile): on CUDA.
FUSIONS = {
    "masked_softmax_fusion": False,
    "gradient_accumulation_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
}
COMPILED_FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion")


def fusions(device_type: str) -> dict[str, bool]:
    """The ``TransformerConfig`` fusion flags on ``device_type``: the compiled ones on CUDA only
    (on CPU, compiling them costs more than it saves)."""
    return {**FUSIONS, **dict.fromkeys(COMPILED_FUSIONS, device_type == "cuda")}


class MegatronBackend(Backend):
    """One role's model on one rank: this rank's tensor shard of its pipeline stage."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.opts: MegatronOptions = spec.options if spec.options is not None else MegatronOptions()
        self.device = device_for(spec.dist)
        if spec.head not in ("lm", "value"):
            raise ValueError(
                f"role {spec.role!r} asks for head {spec.head!r}, which the megatron backend does not build (it builds lm and value); "
                "use backend.name=fsdp for this role's recipe"
            )
        config = AutoConfig.from_pretrained(spec.model_path)
        if expert_counts(config) is not None:
            raise ValueError(
                f"model {spec.model_path!r} ({config.model_type}) is a mixture-of-experts model, which the megatron backend does "
                "not build in this version (its bridge builds dense GPT models; expert parallelism and routing replay are not "
                "wired); use backend.name=fsdp for it"
            )

    # -- set-up -----------------------------------------------------------------------------
    def build(self) -> None:
        if self.opts.dtype not in (*DTYPES, "auto"):
            raise ValueError(f"backend.dtype={self.opts.dtype!r} is not a dtype; valid: {', '.join(DTYPES)}, auto")
        init_parallel(self.spec.dist)
        torch.manual_seed(self.spec.seed)
        if self.device.type == "cuda":
            model_parallel_cuda_manual_seed(self.spec.seed)
        dtype = DTYPES[self.opts.activation_dtype(self.device.type)]
        self.hf_config = AutoConfig.from_pretrained(self.spec.model_path)
        self.bridge = make_bridge(
            self.hf_config,
            dtype,
            vocab_multiple=self.spec.dist.mesh.tp,
            use_cpu_initialization=self.device.type == "cpu",
            sequence_parallel=self.opts.sequence_parallel,
            bf16=dtype is torch.bfloat16,
            fp16=dtype is torch.float16,
            # the objective's loss is already each micro-batch's share of the global loss:
            # no averaging over micro-batches or data-parallel ranks (gradients are summed)
            calculate_per_token_loss=True,
            variable_seq_lengths=True,
            **fusions(self.device.type),
        )
        model = build_gpt(self.bridge, self.spec.head, self.spec.seed).to(self.device)
        with torch.no_grad():  # Megatron's local RMSNorm is built in float32 whatever params_dtype says
            for param in model.parameters():
                param.data = param.data.to(dtype)
        # a causal LM's folder has no value head: a critic starts from a fresh one
        load_hf(self.bridge, model, _read_safetensors(self.spec.model_path), optional=("score.weight", "score.bias"))
        self.model = model
        self.optimizer = None
        if self.spec.trainable:
            self._build_optimizer(model, dtype)
        else:
            model.eval()

    def _build_optimizer(self, model, dtype: torch.dtype) -> None:
        cfg = self.spec.optim
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=self.opts.distributed_optimizer
        )
        self.ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        optim_config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1],
            adam_eps=cfg.eps,
            clip_grad=0.0,  # clipped in optimizer_step, after the non-finite check
            bf16=dtype is torch.bfloat16,
            fp16=dtype is torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=self.opts.distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(optim_config, [self.ddp])
        self.lr_of = lr_factor(cfg.warmup_steps, cfg.lr_schedule, cfg.min_lr_ratio, self.spec.total_steps, cfg.warmup_from_zero)
        self.lr_steps = 0
        self._set_lr()
        model.config.finalize_model_grads_func = _finalize_summed
        model.train()

    def _set_lr(self) -> float:
        lr = self.spec.optim.lr * self.lr_of(self.lr_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    # -- forward and backward -------------------------------------------------------------------
    @property
    def _module(self):
        return self.ddp if self.optimizer is not None else self.model

    def _run(self, micros: list[Batch], outputs: tuple[str, ...], loss_fn: LossFn | None) -> list:
        """``forward_backward_func`` over ``micros``: per micro-batch, the outputs (``loss_fn``
        None: forward only, returns their dicts) or ``loss_fn``'s metrics; every pipeline stage
        gets the last stage's results."""
        vocab = self.hf_config.vocab_size

        def loss(micro: Batch, out: torch.Tensor):
            values = role_outputs(out, micro, outputs, self.spec.head, vocab)
            if loss_fn is None:
                return out.new_zeros(()), torch.zeros((), dtype=torch.int), {k: v.detach().cpu() for k, v in values.items()}
            value, metrics = loss_fn(micro, values)
            return value, torch.zeros((), dtype=torch.int), metrics

        def step(data, model):
            micro = next(data)
            ids = micro["input_ids"].to(self.device)
            return model(ids, _positions(ids), _mask(micro["attention_mask"].to(self.device))), functools.partial(loss, micro)

        results = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(micros),
            model=[self._module],
            num_microbatches=len(micros),
            seq_length=max(m["input_ids"].shape[1] for m in micros),
            micro_batch_size=max(len(m) for m in micros),
            forward_only=loss_fn is None,
        )
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            box = [results if mpu.is_pipeline_last_stage() else None]
            last = dist.get_global_rank(mpu.get_pipeline_model_parallel_group(), mpu.get_pipeline_model_parallel_world_size() - 1)
            dist.broadcast_object_list(box, src=last, group=mpu.get_pipeline_model_parallel_group())
            results = box[0]
        return results

    def forward(self, micros: list[Batch], outputs: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
        with torch.no_grad():
            return self._run(micros, outputs, None)

    def forward_backward(self, micros: list[Batch], outputs: tuple[str, ...], loss_fn: LossFn) -> list[dict[str, float]]:
        # Megatron's DDP sums the gradients over data-parallel ranks (calculate_per_token_loss),
        # and each loss is already this rank's share of the global mini-batch.
        return self._run(micros, outputs, loss_fn)

    def optimizer_step(self) -> dict[str, float]:
        """Clip to ``grad_clip`` (0: none) by the global norm over every shard, step unless the
        norm is not finite, zero the gradients."""
        opt = self.optimizer
        opt.prepare_grads()
        norm = float(opt.get_grad_norm())
        skipped = 0.0 if math.isfinite(norm) else 1.0
        if not skipped:
            clip = self.spec.optim.grad_clip / (norm + 1e-6)
            if 0 < clip < 1:
                # Megatron's clip_grad_by_total_norm_fp32 asserts CUDA tensors; this is the same scaling
                torch._foreach_mul_([p.grad for p in opt.get_parameters() if p.grad is not None], clip)
            opt.step_with_ready_grads()
        opt.zero_grad()
        self.ddp.zero_grad_buffer()
        return {"grad_norm": norm, "skipped_steps": skipped}

    def lr_step(self) -> float:
        lr = self.optimizer.param_groups[0]["lr"]
        self.lr_steps += 1
        self._set_lr()
        return lr

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return all_reduce_sum(values, self.device)

    # -- weights ---------------------------------------------------------------------------------------
    def export_weights(self, bucket_bytes: int = 64 << 20, all_ranks: bool = False, dtype: torch.dtype | None = None) -> Iterator[WeightBucket]:
        """Full tensors under HF names (cast to ``dtype`` if given), in buckets of about
        ``bucket_bytes``, gathered one tensor at a time as the buckets are consumed: every rank
        takes part in the gathers; ranks other than 0 get nothing unless ``all_ranks`` (then
        every rank gets the tensors on its device, for an engine beside it; else on CPU)."""
        stream = ((name, tensor if dtype is None else tensor.to(dtype)) for name, tensor in export_hf(self.bridge, self.model, to_cpu=not all_ranks))
        if all_ranks or dist.get_rank() == 0:
            yield from weight_buckets(stream, bucket_bytes)
        else:
            for _ in stream:  # take part in every gather, keep nothing
                pass

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> full shape of each exported tensor, in export order, without gathering."""
        return hf_shapes(self.bridge, self.model)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full HF tensors (every rank gets all of them); each rank keeps its shard."""
        load_hf(self.bridge, self.model, dict(weights))

    def close(self) -> None:
        """Leave Megatron's groups and the process group (idempotent; the first role of a process
        to close ends them for every role colocated there)."""
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        leave_process_group()

    # -- checkpoints ------------------------------------------------------------------------------------
    def _sharded_state(self, loading: bool) -> dict:
        model_state = self.model.sharded_state_dict()
        state = {"model": model_state}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.sharded_state_dict(model_state, is_loading=loading)
        return state

    def save(self, path: Path) -> None:
        """Model and optimizer through Megatron's distributed checkpointing (torch_dist format:
        each rank writes its shards, which load on any tp/pp/dp layout), plus ``rank<r>.pt``:
        this rank's LR-schedule position and RNG states."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(self._sharded_state(loading=False), str(path))
        extra = {"lr_steps": self.lr_steps if self.optimizer is not None else None, "rng": get_rng_state()}
        torch.save(extra, path / f"rank{self.spec.dist.rank}.pt")

    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote, on this run's layout. A role without an optimizer
        (``ref``, an export) loads the model weights alone."""
        path = Path(path)
        state = dist_checkpointing.load(self._sharded_state(loading=True), str(path), strict="assume_ok_unexpected")
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        extra_file = path / f"rank{self.spec.dist.rank}.pt"
        if extra_file.is_file():
            extra = torch.load(extra_file, weights_only=True)
            if self.optimizer is not None and extra["lr_steps"] is not None:
                self.lr_steps = extra["lr_steps"]
                self._set_lr()
            set_rng_state(extra["rng"])


def _finalize_summed(models, num_tokens=None, **kwargs) -> None:
    """Megatron's gradient finalisation (data-parallel reduce, tied embeddings over pipeline
    stages) without its division by the token count: the losses are already normalised."""
    finalize_model_grads(models, None, **kwargs)


def _positions(ids: torch.Tensor) -> torch.Tensor:
    """``(batch, seq_len)`` 0..seq_len-1. Megatron's RoPE reads positions from the sequence
    index; with left-padded prompts only the relative positions of attended tokens enter
    attention, so this equals HF's ``position_ids = cumsum(mask) - 1``."""
    return torch.arange(ids.shape[1], device=ids.device).expand_as(ids)


def _mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's attention mask ``(batch, 1, seq, seq)``, True where a query may NOT attend:
    later positions and padding."""
    seq = attention_mask.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril()
    return ~(causal[None] & attention_mask.bool()[:, None, :])[:, None]


def _read_safetensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors files (on the CPU)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model.path={folder!r} holds no *.safetensors weights; the megatron backend loads safetensors only")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors
