"""The Tinker API's verbs over trellis: sessions, training clients (full fine-tuning or LoRA), sampling
sessions and checkpoints. Each verb checks its request at once (a refusal names the field) and
queues its work; the HTTP layer (``server.py``) only decodes, authenticates and answers."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker import types

from trellis_service.checkpoints import Checkpoints
from trellis_service.errors import UserError
from trellis_service.futures import Futures, Lane, Result
from trellis_service.sampling import Sampler
from trellis_service.training import ModelShape, TrainedModel, read_shape
from trellis_service.wire import FwdBwdRequest, encode_forward_backward

SNAPSHOTS_KEPT = 4  # unnamed sampler weights kept per training client (an RL loop saves one per step)


@dataclass
class ServeConfig:
    """What ``trellis serve`` was started with: base model names -> folders, where checkpoints go, the
    backend that trains and the engine that samples, and how many requests may wait."""

    models: dict[str, Path]
    root: Path
    backend: str = "fsdp"
    engine: str = "hf"
    max_queue: int = 256


class Service:
    def __init__(self, config: ServeConfig, registry) -> None:
        self.config, self.registry = config, registry
        self.checkpoints = Checkpoints(config.root)
        self.checkpoints.sweep()
        self.futures = Futures(config.max_queue)
        self.sessions: set[str] = set()
        self.models: dict[str, TrainedModel] = {}
        self.lanes: dict[str, Lane] = {}
        self.samplers: dict[str, tuple[str, Path, str | None]] = {}  # id -> base model, folder, tinker path
        self.engines: dict[str, Sampler] = {}  # base model name -> its engine and scorer
        self.snapshots: dict[str, list[str]] = {}  # model id -> its unnamed samplers, oldest first
        self.replaced: set[str] = set()  # samplers whose unnamed weights newer snapshots replaced
        self._ids = itertools.count()
        self._tokenizers: dict[str, Any] = {}

    def close(self) -> None:
        """Stop the worker after the request it runs, and release the engines (their processes,
        their process groups) while the process can still do so cleanly."""
        self.futures.worker.shutdown(wait=True, cancel_futures=True)
        for sampler in self.engines.values():
            sampler.engine.close()

    # -- sessions and capabilities ---------------------------------------------------------------------
    def capabilities(self) -> dict:
        from transformers import AutoConfig

        supported = []
        for name, folder in self.config.models.items():
            context = getattr(AutoConfig.from_pretrained(folder), "max_position_embeddings", None)
            supported.append({"model_name": name, "max_context_length": context, "trainable": True, "sampleable": True})
        return {"supported_models": supported}

    def create_session(self, body: dict) -> dict:
        types.CreateSessionRequest.model_validate(body)
        session_id = uuid.uuid4().hex[:16]
        self.sessions.add(session_id)
        return {"type": "create_session", "session_id": session_id}

    def _session(self, session_id: str) -> str:
        if session_id not in self.sessions:
            raise UserError(
                f"session_id {session_id!r} is unknown or finished (sessions end with ServiceClient.close and when the server "
                "restarts); create a new ServiceClient"
            )
        return session_id

    def live(self, session_id: str) -> bool:
        return session_id in self.sessions

    def finish_session(self, session_id: str) -> None:
        """A closed ServiceClient's session: refused from now on, its training clients' models freed
        (their checkpoints stay)."""
        self.sessions.discard(session_id)
        for model_id in [m for m in self.lanes if m.startswith(f"{session_id}:")]:
            for request_id, _ in self.lanes.pop(model_id).waiting.values():  # waiting for a seq_id that will not come
                self.futures.release(request_id)
            self.models.pop(model_id, None)

    def _folder(self, base_model: str) -> Path:
        folder = self.config.models.get(base_model)
        if folder is None:
            known = ", ".join(self.config.models) or "none"
            raise UserError(f"base_model {base_model!r} is not served here; served: {known} (trellis serve --model NAME=FOLDER)")
        return folder

    def tokenizer(self, base_model: str):
        if base_model not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[base_model] = AutoTokenizer.from_pretrained(self._folder(base_model))
        return self._tokenizers[base_model]

    # -- training clients --------------------------------------------------------------------------------
    def create_model(self, body: dict) -> str:
        request = types.CreateModelRequest.model_validate(body)
        model_id = f"{self._session(request.session_id)}:train:{request.model_seq_id}"
        shape = model_shape(request.base_model, request.lora_config)
        self._check_optimizer(request.optimizer_config)
        folder = self._folder(request.base_model)
        check_unembed(shape, folder)
        return self._start_model(model_id, first_seq=1, job=lambda: self._build(model_id, shape, folder))

    def _check_optimizer(self, optimizer) -> None:
        if optimizer is not None and not isinstance(optimizer, types.AdamOptimizerConfig):
            raise UserError(f"optimizer_config type {optimizer.type!r} is not supported; this server trains with AdamW (type 'adamw')")

    def _start_model(self, model_id: str, first_seq: int, job) -> str:
        if model_id in self.lanes:
            raise UserError(f"model {model_id!r} exists already; model_seq_id must be new within its session")
        request_id = self.futures.reserve()
        self.lanes[model_id] = Lane(model_id, first_seq)
        self.futures.run(request_id, job)
        return request_id

    def _build(self, model_id: str, shape: ModelShape, folder: Path) -> dict:
        self.models[model_id] = TrainedModel(model_id, shape, folder, self.registry, self.config.backend)
        return {"type": "create_model", "model_id": model_id}

    def model(self, model_id: str) -> TrainedModel:
        if model_id not in self.models:
            raise UserError(f"model_id {model_id!r} is unknown to this server; create a training client first")
        return self.models[model_id]

    def get_info(self, body: dict) -> dict:
        request = types.GetInfoRequest.model_validate(body)
        model = self.model(request.model_id)
        shape = model.shape
        data = {"model_name": shape.base_model, "tokenizer_id": str(model.folder), "arch": "trellis"}
        return {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": data,
            "is_lora": shape.lora_rank > 0,
            "lora_rank": shape.lora_rank or None,
            "model_name": shape.base_model,
        }

    def _queue(self, model_id: str, seq_id: int | None, job) -> str:
        """Queue ``job`` in ``model_id``'s lane at ``seq_id``; the request id that answers it."""
        if model_id not in self.lanes:
            raise UserError(f"model_id {model_id!r} is unknown to this server; create a training client first")
        if seq_id is None:
            raise UserError("seq_id is missing; the SDK numbers each training client's requests from 1")
        request_id = self.futures.reserve()
        try:
            ready = self.lanes[model_id].admit(seq_id, (request_id, job))
        except UserError:
            self.futures.release(request_id)
            raise
        for runnable in ready:
            self.futures.run(*runnable)
        return request_id

    def forward_backward(self, request: FwdBwdRequest) -> str:
        def job() -> Result:
            outputs, metrics = self.model(request.model_id).forward_backward(request)
            return encode_forward_backward(outputs, metrics)

        return self._queue(request.model_id, request.seq_id, job)

    def optim_step(self, body: dict) -> str:
        request = types.OptimStepRequest.model_validate(body)
        params = request.optim_params
        if not isinstance(params, types.AdamParams):
            raise UserError(f"optim_params of type {getattr(params, 'type', type(params).__name__)!r} are not supported; send AdamParams")
        return self._queue(request.model_id, request.seq_id, lambda: {"metrics": self.model(request.model_id).optim_step(params)})

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save_weights(self, body: dict) -> str:
        request = types.SaveWeightsRequest.model_validate(body)
        check_ttl(request.ttl_seconds)
        name = request.path or f"state-{next(self._ids)}"

        def job() -> Result:
            self.checkpoints.sweep()
            path, folder = self.checkpoints.new(request.model_id, "weights", name, request.overwrite)
            self.model(request.model_id).save_state(folder)
            self.checkpoints.keep_for(folder, request.ttl_seconds)
            return {"type": "save_weights", "path": path}

        return self._queue(request.model_id, request.seq_id, job)

    def load_weights(self, body: dict) -> str:
        request = types.LoadWeightsRequest.model_validate(body)
        _, folder = self.checkpoints.find(request.path, "weights")
        if request.session_id is not None:  # a new training client made from the checkpoint
            model_id = f"{self._session(request.session_id)}:train:{request.model_seq_id}"
            saved = read_shape(folder)
            shape = dataclasses.replace(saved, base_model=request.base_model or saved.base_model)
            self._check_optimizer(request.optimizer_config)
            base = self._folder(shape.base_model)
            check_unembed(shape, base)

            def create() -> Result:
                self._build(model_id, shape, base)
                self.models[model_id].load_state(folder, request.optimizer)
                return {"type": "load_weights", "path": request.path, "model_id": model_id}

            return self._start_model(model_id, first_seq=1, job=create)
        if request.model_id is None:
            raise UserError("load_weights needs model_id (an existing client) or session_id with model_seq_id (a new client)")

        def load() -> Result:
            self.model(request.model_id).load_state(folder, request.optimizer)
            return {"type": "load_weights", "path": request.path}

        return self._queue(request.model_id, request.seq_id, load)

    def save_for_sampler(self, body: dict) -> str:
        request = types.SaveWeightsForSamplerRequest.model_validate(body)
        if request.kind != "snapshot":
            raise UserError(f"kind={request.kind!r} sampling clients are not supported; this server makes snapshots (kind='snapshot')")
        check_ttl(request.ttl_seconds)
        named = request.path is not None
        name = request.path if named else f"ephemeral-{next(self._ids)}"

        def job() -> Result:
            model = self.model(request.model_id)
            self.checkpoints.sweep()
            path, folder = self.checkpoints.new(request.model_id, "sampler_weights", name)
            model.save_for_sampler(folder, self.tokenizer(model.shape.base_model))
            self.checkpoints.keep_for(folder, request.ttl_seconds)
            if named:
                return {"type": "save_weights_for_sampler", "path": path}
            sampler_id = self._new_sampler(model.shape.base_model, folder, path)
            self._keep_latest_snapshots(request.model_id, sampler_id)
            return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}

        return self._queue(request.model_id, request.seq_id, job)

    def _keep_latest_snapshots(self, model_id: str, sampler_id: str) -> None:
        """Unnamed sampler weights (``save_weights_and_get_sampling_client()``, once per RL step) are
        kept for the latest ``SNAPSHOTS_KEPT`` of a model; older ones are deleted with their sessions."""
        kept = self.snapshots.setdefault(model_id, [])
        kept.append(sampler_id)
        while len(kept) > SNAPSHOTS_KEPT:
            old = kept.pop(0)
            _, folder, _ = self.samplers.pop(old)
            shutil.rmtree(folder, ignore_errors=True)
            self.replaced.add(old)

    # -- sampling ------------------------------------------------------------------------------------------
    def create_sampling_session(self, body: dict) -> dict:
        request = types.CreateSamplingSessionRequest.model_validate(body)
        self._session(request.session_id)
        if request.model_path is not None:
            _, folder = self.checkpoints.find(request.model_path, "sampler_weights")
            base = read_shape(folder).base_model
        elif request.base_model is not None:
            base, folder = request.base_model, self._folder(request.base_model)
        else:
            raise UserError("create_sampling_session needs model_path (tinker://.../sampler_weights/...) or base_model")
        return {"type": "create_sampling_session", "sampling_session_id": self._new_sampler(base, folder, request.model_path)}

    def _new_sampler(self, base_model: str, folder: Path, path: str | None) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex[:16]}"
        self.samplers[sampler_id] = (base_model, folder, path)
        return sampler_id

    def sampler_info(self, sampler_id: str) -> dict:
        if sampler_id in self.replaced:
            raise UserError(
                f"sampling session {sampler_id!r} sampled unnamed weights that {SNAPSHOTS_KEPT} newer snapshots of its model replaced "
                "(they are deleted); sample from a newer one, or save named weights (save_weights_for_sampler(name))"
            )
        if sampler_id not in self.samplers:
            raise UserError(f"sampling session {sampler_id!r} is unknown to this server")
        base, _, path = self.samplers[sampler_id]
        return {"sampler_id": sampler_id, "base_model": base, "model_path": path}

    def sample(self, body: dict) -> tuple[str, list[str]]:
        request = types.SampleRequest.model_validate(body)
        if request.sampling_session_id is not None:
            self.sampler_info(request.sampling_session_id)
            base, folder, _ = self.samplers[request.sampling_session_id]
        elif request.model_path is not None:
            _, folder = self.checkpoints.find(request.model_path, "sampler_weights")
            base = read_shape(folder).base_model
        else:
            base = request.base_model or ""
            folder = self._folder(base)
        base_folder = self._folder(base)
        request_id = self.futures.reserve()
        self.futures.run(request_id, lambda: self._sampler(base, base_folder).sample(folder, request))
        return request_id, [f"{request_id}-{i}" for i in range(request.num_samples)]

    def _sampler(self, base: str, folder: Path) -> Sampler:
        """The base model's sampler (its engine built on first use)."""
        if base not in self.engines:
            self.engines[base] = Sampler(folder, self.registry, self.config.engine, self.config.backend)
        return self.engines[base]


def check_unembed(shape: ModelShape, folder: Path) -> None:
    """Refuse a LoRA adapter on the unembedding of a model whose unembedding is its embedding (tied):
    the merged sampler weights could not stay tied."""
    from transformers import AutoConfig

    if shape.lora_rank and shape.train_unembed and getattr(AutoConfig.from_pretrained(folder), "tie_word_embeddings", False):
        raise UserError(
            f"train_unembed=True: {shape.base_model!r} ties its unembedding to its embedding, which a LoRA adapter on the "
            "unembedding would untie; pass train_unembed=False (or serve a model with untied embeddings)"
        )


def model_shape(base_model: str, lora) -> ModelShape:
    """A new training client's shape from its ``lora_config``: ``rank`` 0 is full fine-tuning (every
    weight trains, so the layer flags must keep their default True)."""
    if lora is None or lora.rank == 0:
        if lora is not None and not (lora.train_mlp and lora.train_attn and lora.train_unembed):
            raise UserError("lora_config.rank=0 is full fine-tuning, which trains every weight: leave train_mlp, train_attn and train_unembed True")
        return ModelShape(base_model, 0)
    if lora.rank < 0:
        raise UserError(f"lora_config.rank={lora.rank} must be >= 1 for LoRA, or 0 for full fine-tuning")
    if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
        raise UserError("lora_config: train_mlp, train_attn and train_unembed are all False; the adapter would train nothing")
    return ModelShape(base_model, lora.rank, lora.train_mlp, lora.train_attn, lora.train_unembed, lora.seed or 0)


def check_ttl(ttl_seconds: int | None) -> None:
    if ttl_seconds is not None and ttl_seconds <= 0:
        raise UserError(f"ttl_seconds={ttl_seconds} must be positive (or None: kept until deleted)")
