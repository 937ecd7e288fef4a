"""Sampling clients' work: one base model's trellis rollout engine samples and a frozen trellis backend
scores prompts (their log-probs and top-k) and the top-k of sampled tokens, each holding one
folder's weights at a time (the base model's own, or sampler weights a training client saved),
swapped in memory as a training run syncs its engine, and checked by digest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from trellis import BackendSpec, Batch, RolloutSpec, SamplingParams
from trellis.kit.engine import tensor_digest
from trellis_service.datums import datum_batch
from trellis_service.errors import UserError
from trellis_service.wire import Sequence, WireDatum, encode_samples

MASK_LOGPROB = -99999.0  # the SDK's sentinel for a top-k row that was not computed (the first prompt token)


class Scorer:
    """A frozen backend on ``folder``: the log-prob of each next token of a sequence, and the top-k there."""

    def __init__(self, folder: Path, registry, backend: str) -> None:
        entry = registry.get("backend", backend)
        self.backend = entry.obj(BackendSpec("sampler", str(folder), entry.options() if entry.options else None, False))
        self.backend.build()

    def score(self, tokens: list[int], k: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """For ``tokens`` of length ``L``: ``log p(tokens[j] | tokens[:j])`` for ``j`` in ``1..L-1``
        ``(L - 1,)``, and with ``k`` the top-k ``(ids, log-probs)`` each ``(L - 1, k)`` there."""
        batch = datum_batch([WireDatum(tokens[:-1], {"target_tokens": np.asarray(tokens[1:], dtype=np.int64)})])
        batch.meta["top_k"] = k
        outputs = ("top_ids_log_probs", *(("top_log_probs", "top_ids") if k else ()))
        out = self.backend.forward([batch], outputs)[0]
        logprobs = out["top_ids_log_probs"][0, :, 0].float().numpy()
        top = (out["top_ids"][0].numpy(), out["top_log_probs"][0].float().numpy()) if k else None
        return logprobs, top


def folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face folder's safetensors files, by name."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} holds no safetensors weights")
    return {name: tensor for f in files for name, tensor in load_file(str(f)).items()}


def sync_checked(engine, weights: dict[str, torch.Tensor]) -> None:
    """Load ``weights`` into ``engine`` and check each tensor's digest as the engine holds it (an
    engine that cannot tell is trusted, as in training runs without a digest)."""
    engine.load_weights(list(weights.items()))  # the service never puts an engine to sleep
    held = engine.weight_checksums(list(weights))
    if held is None:
        return
    dtype = engine.weight_dtype
    wrong = [name for name, t in weights.items() if name in held and held[name] != tensor_digest(t.to(dtype) if dtype else t)]
    if wrong:
        raise RuntimeError(f"the rollout engine holds other values than the sampler weights for {wrong[:3]} after loading them")


class Sampler:
    """One base model's rollout engine and frozen scorer; :meth:`sample` swaps in a folder's weights first."""

    def __init__(self, base: Path, registry, engine: str, backend: str, seed: int = 0) -> None:
        from transformers import AutoTokenizer

        self.base, self.registry, self.backend_name = base, registry, backend
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        entry = registry.get("rollout", engine)
        self.engine = entry.obj(RolloutSpec(str(base), entry.options() if entry.options else None, self.tokenizer, seed=seed))
        self.engine_holds = base
        self._scorer: Scorer | None = None
        self.scorer_holds = base

    def _hold(self, folder: Path) -> None:
        if folder != self.engine_holds:
            sync_checked(self.engine, folder_weights(folder))
            self.engine_holds = folder

    @property
    def scorer(self) -> Scorer:
        if self._scorer is None:
            self._scorer = Scorer(self.base, self.registry, self.backend_name)
        if self.scorer_holds != self.engine_holds:
            self._scorer.backend.load_weights(folder_weights(self.engine_holds).items())
            self.scorer_holds = self.engine_holds
        return self._scorer

    def sample(self, folder: Path, request) -> bytes:
        """A Tinker ``SampleRequest``'s answer from ``folder``'s weights, as the protobuf ``SampleResponse``."""
        if not folder.is_dir():
            raise UserError(f"the sampler weights at {folder} were deleted; sample from newer ones")
        self._hold(folder)
        prompt = _prompt_tokens(request.prompt)
        refuse_unsupported(request, len(prompt))
        params = request.sampling_params
        stop_ids, stop_texts = self._stops(params.stop)
        sampling = SamplingParams(
            n=request.num_samples,
            temperature=float(params.temperature),  # the SDK's default is the int 1, which samplers refuse
            top_p=float(params.top_p),
            top_k=int(params.top_k),
            max_new_tokens=params.max_tokens,
            greedy=params.temperature == 0,
            stop_token_ids=stop_ids,
            seed=params.seed,
        )
        ids = torch.tensor([prompt], dtype=torch.long)
        out = self.engine.generate(Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}), sampling)
        sequences = [self._sequence(out, row, params.max_tokens, stop_ids, stop_texts) for row in range(len(out))]
        k = request.topk_sample_logprobs
        if k:
            for s in sequences:
                if s.tokens:
                    _, (top_ids, top_lps) = self.scorer.score(prompt + s.tokens, k)
                    s.topk = (top_ids[-len(s.tokens) :], top_lps[-len(s.tokens) :])
        prompt_lps, prompt_top = self._prompt_scores(request, prompt)
        return encode_samples(sequences, prompt_lps, prompt_top)

    def _stops(self, stop) -> tuple[list[int], list[str]]:
        """Stop token ids, and stop strings that are not one token (cut from the decoded text)."""
        if stop is None:
            return [], []
        items = [stop] if isinstance(stop, str) else list(stop)
        if not items:
            raise UserError("sampling_params.stop=[] (no stop, not even at EOS) is not supported; leave stop unset to stop at EOS")
        if all(isinstance(s, int) for s in items):
            return items, []
        ids, texts = [], []
        for s in items:
            encoded = self.tokenizer.encode(s, add_special_tokens=False)
            if len(encoded) == 1 and self.tokenizer.decode(encoded) == s:
                ids.append(encoded[0])
            else:
                texts.append(s)
        return ids, texts

    def _sequence(self, out: Batch, row: int, limit: int, stop_ids: list[int], stop_texts: list[str]) -> Sequence:
        """One sample: its tokens through the first stop token, cut after a stop string."""
        n = int(out["response_mask"][row].sum())
        tokens = out["responses"][row, :n].tolist()
        logprobs = out["rollout_log_probs"][row, :n].tolist()
        # the engine ends a sample at a stop token (kept) or at the limit
        stopped = n < limit or (bool(tokens) and (tokens[-1] in stop_ids or tokens[-1] == self.tokenizer.eos_token_id))
        for end in range(1, len(tokens) + 1) if stop_texts else ():
            if any(s in self.tokenizer.decode(tokens[:end]) for s in stop_texts):
                return Sequence(tokens[:end], logprobs[:end], "stop")
        return Sequence(tokens, logprobs, "stop" if stopped else "length")

    def _prompt_scores(self, request, prompt: list[int]):
        k = request.topk_prompt_logprobs
        if not (request.prompt_logprobs or k) or len(prompt) < 2:
            return None, None
        logprobs, top = self.scorer.score(prompt, k)
        lps = np.concatenate([[np.nan], logprobs]).astype(np.float32)
        last_n = request.prompt_logprobs_last_n
        if last_n is not None:
            lps[: len(prompt) - last_n] = np.nan
        if top is not None:
            ids = np.concatenate([np.zeros((1, k), dtype=np.int64), top[0]])
            values = np.concatenate([np.full((1, k), MASK_LOGPROB, dtype=np.float32), top[1]])
            top = (ids, values)
        return (lps if request.prompt_logprobs else None), top


def _prompt_tokens(model_input) -> list[int]:
    try:
        tokens = model_input.to_ints()
    except ValueError as exc:
        raise UserError(f"prompt: {exc}; this server samples from text models only") from exc
    if not tokens:
        raise UserError("prompt is empty; send at least one token")
    return tokens


def refuse_unsupported(request, prompt_len: int) -> None:
    """Refuse what this server would otherwise ignore, naming the field."""
    params = request.sampling_params
    if params.max_tokens is None or params.max_tokens < 1:
        raise UserError(f"sampling_params.max_tokens={params.max_tokens!r}: set it to at least 1")
    if request.num_samples < 1:
        raise UserError(f"num_samples={request.num_samples}: ask for at least one sample")
    if request.target_prompt_logprobs is not None:
        raise UserError("target_prompt_logprobs is not supported by this server; use topk_prompt_logprobs or compute_logprobs")
    if request.prompt_alt_tokens_k:
        raise UserError("prompt_alt_tokens_k is not supported by this server; leave it 0")
    if request.record_stability_info:
        raise UserError("record_stability_info (StableReinforce) is not supported by this server; leave it false")
