"""FSDP2 workers for the actor, critic, ref and reward_model roles, on any Hugging Face model."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from trellis.batch import Batch
from trellis.config import instantiate_options
from trellis.rng import get_rng_state, set_rng_state
from trellis.signatures import Aggregation, PolicyLossInputs
from trellis.workers import WeightBucket, Worker, WorkerSpec
from trellis_algos.aggregation import aggregation_for
from trellis_algos.entropy import entropy_from_logits, entropy_loss
from trellis_algos.kl import kl_loss
from trellis_algos.value_loss import clipped_value_loss
from trellis_fsdp.distributed import all_reduce_sum, device_for, ensure_process_group
from trellis_fsdp.optim import make_optimizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class FSDPOptions:
    """dtype: the weights' dtype. param_dtype / reduce_dtype: FSDP2 mixed precision (compute and
    gradient-reduction dtypes; None = the weights' dtype). entropy_chunk_size: rows of logits per
    chunk when computing entropy (bounds memory for large vocabularies)."""

    dtype: str = "float32"
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    activation_checkpointing: bool = False
    entropy_chunk_size: int | None = 2048


def make_worker(spec: WorkerSpec) -> Worker:
    return FSDPWorker(spec)


class FSDPWorker(Worker):
    """One role on one rank: the model fully sharded per decoder layer and at the root."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.role = spec.role
        self.opts: FSDPOptions = spec.options if spec.options is not None else FSDPOptions()
        self.cfg = spec.role_options
        self.device = device_for(spec.dist)
        self._components: dict[str, tuple] = {}

    # -- set-up -----------------------------------------------------------------------------
    def build(self) -> None:
        for name in ("dtype", "param_dtype", "reduce_dtype"):
            value = getattr(self.opts, name)
            if value is not None and value not in DTYPES:
                raise ValueError(f"backend.{name}={value!r} is not a dtype; valid: {', '.join(DTYPES)}")
        self.mesh = ensure_process_group(self.spec.dist)
        torch.manual_seed(self.spec.seed)
        self.model = self._load_model()
        if self.opts.activation_checkpointing and self.role in ("actor", "critic"):
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._shard()
        self.optimizer = self.scheduler = None
        if self.role in ("actor", "critic"):
            self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), self.cfg.optim, self.spec.total_steps)
            self.model.train()
        else:
            self.model.eval()
        self.registry = self.spec.registry

    def _load_model(self) -> torch.nn.Module:
        path = self.spec.model_path
        dtype = DTYPES[self.opts.dtype]
        if self.role in ("critic", "reward_model"):
            model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model.config.use_cache = False
        return model.to(self.device)

    def _shard(self) -> None:
        mp = MixedPrecisionPolicy(
            param_dtype=DTYPES[self.opts.param_dtype] if self.opts.param_dtype else None,
            reduce_dtype=DTYPES[self.opts.reduce_dtype] if self.opts.reduce_dtype else None,
        )
        # Decoder layers are the classes a model declares it must not split across devices.
        layer_classes = tuple(getattr(self.model, "_no_split_modules", None) or ())
        for module in self.model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=self.mesh, mp_policy=mp)
        fully_shard(self.model, mesh=self.mesh, mp_policy=mp)

    # -- forward passes -------------------------------------------------------------------------
    def _micro_batches(self, batch: Batch, cfg) -> list[Batch]:
        if cfg is not None and cfg.max_tokens_per_micro_batch > 0:
            return batch.split_by_tokens(cfg.max_tokens_per_micro_batch, "attention_mask")
        size = cfg.micro_batch_samples if cfg is not None else 8
        return batch.split(max(1, size))

    def _forward_logits(self, micro: Batch) -> torch.Tensor:
        out = self.model(
            input_ids=micro["input_ids"].to(self.device),
            attention_mask=micro["attention_mask"].to(self.device),
            position_ids=micro["position_ids"].to(self.device),
        )
        return out.logits

    def _response_log_probs(self, micro: Batch, temperature: float, with_entropy: bool):
        """log p(response token) ``(b, response_len)`` and entropy (or None), same shape."""
        resp = micro["responses"].to(self.device)
        n = resp.shape[1]
        logits = self._forward_logits(micro)[:, -n - 1 : -1].float() / temperature
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        entropy = entropy_from_logits(logits, self.opts.entropy_chunk_size) if with_entropy else None
        return log_probs, entropy

    def _values(self, micro: Batch) -> torch.Tensor:
        n = micro["responses"].shape[1]
        return self._forward_logits(micro)[:, -n - 1 : -1, 0].float()

    def log_prob(self, batch: Batch, with_entropy: bool = False) -> Batch:
        temperature = float(batch.meta.get("temperature", 1.0))
        outs = defaultdict(list)
        with torch.no_grad():
            for micro in self._micro_batches(batch, self._batching()):
                lp, ent = self._response_log_probs(micro, temperature, with_entropy)
                outs["log_probs"].append(lp.cpu())
                if with_entropy:
                    outs["entropy"].append(ent.cpu())
        self._reshard()
        return Batch({k: torch.cat(v) for k, v in outs.items()})

    def values(self, batch: Batch) -> Batch:
        with torch.no_grad():
            vals = [self._values(m).cpu() for m in self._micro_batches(batch, self._batching())]
        self._reshard()
        return Batch({"values": torch.cat(vals)})

    def score(self, batch: Batch) -> Batch:
        scores = []
        with torch.no_grad():
            for micro in self._micro_batches(batch, None):
                logits = self._forward_logits(micro)[..., 0]
                last = micro["attention_mask"].to(self.device).cumsum(-1).argmax(-1)
                scores.append(logits.gather(-1, last.unsqueeze(-1)).squeeze(-1).float().cpu())
        self._reshard()
        return Batch({"scores": torch.cat(scores)})

    def _batching(self):
        return self.cfg if self.cfg is not None and hasattr(self.cfg, "micro_batch_samples") else None

    def _reshard(self) -> None:
        # After a no_grad forward FSDP2 leaves the root unsharded; reshard so memory and later
        # state-dict calls see the sharded layout.
        self.model.reshard()

    # -- training ---------------------------------------------------------------------------------
    def _global_agg(self, mode: str, mask: torch.Tensor, norm_constant: float | None) -> Aggregation:
        local = aggregation_for(mode, mask, norm_constant)
        return dataclasses.replace(
            local,
            global_tokens=all_reduce_sum(local.global_tokens, self.device),
            global_seqs=all_reduce_sum(local.global_seqs, self.device),
        )

    def _optimizer_step(self) -> dict[str, float]:
        clip = self.cfg.optim.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if torch.isfinite(norm):
            self.optimizer.step()
            skipped = 0.0
        else:  # a non-finite gradient would poison the weights: skip this step, say so in metrics
            skipped = 1.0
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm), "skipped_steps": skipped}

    def _mini_batches(self, batch: Batch, epoch: int) -> list[Batch]:
        cfg = self.cfg
        if cfg.shuffle:
            gen = torch.Generator().manual_seed(self.spec.seed * 1000003 + epoch + 7919 * self.scheduler.last_epoch)
            batch = batch.reorder(torch.randperm(len(batch), generator=gen))
        world = self.spec.dist.world_size
        if cfg.mini_batch_samples and cfg.mini_batch_samples % world:
            raise ValueError(f"mini_batch_samples={cfg.mini_batch_samples} must divide by the {world} data-parallel ranks")
        size = cfg.mini_batch_samples // world if cfg.mini_batch_samples else len(batch)
        return batch.split(size)

    def update(self, batch: Batch) -> dict[str, float]:
        if self.role == "critic":
            return self._train(batch, self._critic_loss, prefix="critic")
        if self.role != "actor":
            raise NotImplementedError(f"role {self.role!r} does not train")
        return self._train(batch, self._actor_loss, prefix="actor")

    def _train(self, batch: Batch, loss_fn, prefix: str) -> dict[str, float]:
        """PPO-style epochs over mini-batches (one optimizer step each) of micro-batches."""
        world = self.spec.dist.world_size
        metrics: dict[str, list[float]] = defaultdict(list)
        for epoch in range(self.cfg.ppo_epochs):
            for mini in self._mini_batches(batch, epoch):
                agg = self._global_agg(self.cfg.loss_agg_mode, mini["response_mask"], getattr(self.cfg, "loss_norm_constant", None))
                summed: dict[str, float] = defaultdict(float)
                averaged: dict[str, list[float]] = defaultdict(list)
                for micro in self._micro_batches(mini, self.cfg):
                    loss, m = loss_fn(micro, agg, float(batch.meta.get("temperature", 1.0)))
                    # FSDP averages gradients over ranks; the loss is already a share of the global
                    # mini-batch, so scale by the world size to get the sum.
                    (loss * world).backward()
                    for k, v in m.items():  # a micro-batch's loss is its share of the mini-batch's: sum them
                        if k.endswith("loss"):
                            summed[k] += v
                        else:
                            averaged[k].append(v)
                for k, v in summed.items():
                    metrics[k].append(all_reduce_sum(v, self.device))
                for k, v in averaged.items():
                    metrics[k].append(sum(v) / len(v))
                for k, v in self._optimizer_step().items():
                    metrics[k].append(v)
        metrics["lr"].append(self.scheduler.get_last_lr()[0])
        self.scheduler.step()
        return {f"{prefix}/{k}": sum(v) / len(v) for k, v in metrics.items()}

    def _component(self, kind: str, node) -> tuple:
        """The registered ``kind`` that config ``node`` names, and its options: looked up once per
        worker, not once per micro-batch."""
        if kind not in self._components:
            entry = self.registry.get(kind, node.name)
            self._components[kind] = (entry.obj, instantiate_options(node, entry.options) if entry.options else None)
        return self._components[kind]

    def _actor_loss(self, micro: Batch, agg: Aggregation, temperature: float):
        cfg = self.cfg
        need_entropy = cfg.entropy_coeff != 0
        log_prob, entropy = self._response_log_probs(micro, temperature, need_entropy)
        mask = micro["response_mask"].to(self.device)
        policy_loss, options = self._component("policy_loss", cfg.policy_loss)
        data = PolicyLossInputs(
            log_prob=log_prob,
            old_log_prob=micro["old_log_probs"].to(self.device),
            advantages=micro["advantages"].to(self.device),
            response_mask=mask,
            rollout_log_prob=micro["rollout_log_probs"].to(self.device) if "rollout_log_probs" in micro else None,
        )
        loss, metrics = policy_loss(data, agg, options)
        metrics = dict(metrics)
        if need_entropy:
            ent = entropy_loss(entropy, mask, agg)
            loss = loss - cfg.entropy_coeff * ent
            metrics["entropy_loss"] = float(ent)
        if cfg.use_kl_loss:
            estimator = self.registry.get("kl", cfg.kl_loss_type).obj
            kl, kl_metrics = kl_loss(log_prob, micro["ref_log_probs"].to(self.device), mask, agg, estimator)
            loss = loss + cfg.kl_loss_coef * kl
            metrics.update(kl_metrics)
        return loss, metrics

    def _critic_loss(self, micro: Batch, agg: Aggregation, temperature: float):
        vpreds = self._values(micro)
        return clipped_value_loss(
            vpreds,
            micro["returns"].to(self.device),
            micro["values"].to(self.device),
            micro["response_mask"].to(self.device),
            agg,
            self.cfg.cliprange_value,
        )

    # -- supervised ----------------------------------------------------------------------------------
    def _sft_loss(self, micro: Batch, agg: Aggregation):
        logits = self._forward_logits(micro)[:, :-1].float()
        labels = micro["input_ids"][:, 1:].to(self.device)
        token_lp = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        sft_loss, options = self._component("sft_loss", self.cfg.loss)
        return sft_loss(token_lp, micro["loss_mask"][:, 1:].to(self.device), agg, options)

    def sft_update(self, batch: Batch) -> dict[str, float]:
        world = self.spec.dist.world_size
        agg = self._global_agg(self.cfg.loss_agg_mode, batch["loss_mask"][:, 1:], None)
        total = 0.0
        for micro in self._micro_batches(batch, self.cfg):
            loss, _ = self._sft_loss(micro, agg)
            (loss * world).backward()
            total += float(loss.detach())
        metrics = {"loss": all_reduce_sum(total, self.device), **self._optimizer_step(), "lr": self.scheduler.get_last_lr()[0]}
        self.scheduler.step()
        return {f"sft/{k}": v for k, v in metrics.items()}

    def sft_eval(self, batch: Batch) -> dict[str, float]:
        agg = self._global_agg(self.cfg.loss_agg_mode, batch["loss_mask"][:, 1:], None)
        with torch.no_grad():
            total = sum(float(self._sft_loss(micro, agg)[0]) for micro in self._micro_batches(batch, self.cfg))
        self._reshard()
        return {"val/loss": all_reduce_sum(total, self.device)}

    # -- weights ---------------------------------------------------------------------------------------
    def export_weights(self, bucket_bytes: int = 64 << 20, all_ranks: bool = False) -> Iterator[WeightBucket]:
        """Full tensors under Hugging Face names, in buckets of about ``bucket_bytes``. Every rank
        takes part in the gather; ranks other than 0 get an empty iterator unless ``all_ranks``."""
        # cpu_offload gathers to rank 0 only; without it every rank receives the full tensors.
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks))
        if dist.get_rank() != 0 and not all_ranks:
            return iter(())
        return _buckets(state.items(), bucket_bytes)

    # -- checkpoints ------------------------------------------------------------------------------------
    def _sharded_state(self) -> dict:
        self._reshard()  # set_model_state_dict needs the sharded layout, which a no_grad forward leaves behind
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def save(self, path: Path) -> None:
        """Model and optimizer through ``torch.distributed.checkpoint`` (each rank writes its own
        shard into ``path``), plus ``rank<r>.pt``: this rank's LR scheduler and RNG states."""
        path = Path(path)
        dcp.save(self._sharded_state(), checkpoint_id=path)
        extra = {"scheduler": self.scheduler.state_dict() if self.scheduler else None, "rng": get_rng_state()}
        torch.save(extra, path / f"rank{self.spec.dist.rank}.pt")

    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote (any number of ranks may have written it: DCP reshards).
        A role without an optimizer (``ref``) loads the model weights alone."""
        path = Path(path)
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=path)
        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra_file = path / f"rank{self.spec.dist.rank}.pt"
        if extra_file.is_file():
            extra = torch.load(extra_file, weights_only=True)
            if self.scheduler is not None and extra["scheduler"] is not None:
                self.scheduler.load_state_dict(extra["scheduler"])
            set_rng_state(extra["rng"])


def _buckets(items, bucket_bytes: int) -> Iterator[WeightBucket]:
    bucket: WeightBucket = []
    size = 0
    for name, tensor in items:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
