"""What a rollout engine (kind ``rollout``) needs: its interface, stop tokens and padding, the sample layout, checked weight updates."""

from trellis.data import left_pad
from trellis.interfaces.backend import IMAGE_INPUTS, MODEL_INPUTS, WeightBucket, weight_buckets
from trellis.interfaces.hf import causal_lm_class, grouped_query_sdpa, image_kwargs
from trellis.interfaces.moe import ROUTED_EXPERTS, generated_routes, own_routing, recorded_routes
from trellis.interfaces.rollout import (
    ALL_MEMORY,
    KV_CACHE,
    WEIGHTS,
    Generation,
    RolloutEngine,
    RolloutSpec,
    Routes,
    SamplingParams,
    context_length,
    engine_dtype,
    log_once,
    option_dtype,
    pad_id,
    rollout_batch,
    samples_batch,
    sleep_skipped,
    stop_ids,
)
from trellis.interfaces.transport import tensor_digest
from trellis.interfaces.weights import DEFAULT_PACKED, WeightSyncError, checkpoint_names, engine_weights, prepare_update
from trellis.rng import get_rng_state, sampling_generator, set_rng_state

__all__ = [
    # the interface
    "RolloutEngine",
    "RolloutSpec",
    "SamplingParams",
    "Generation",
    "Routes",
    # the model: dtype, context, stop and pad tokens
    "engine_dtype",
    "option_dtype",
    "context_length",
    "stop_ids",
    "pad_id",
    # the prompt fields an engine reads (RolloutEngine.model_inputs): token ids, and images for one that takes them
    "MODEL_INPUTS",
    "IMAGE_INPUTS",
    # a Hugging Face folder's model class (vision-language or text) and a micro-batch's image inputs to it
    "causal_lm_class",
    "image_kwargs",
    # grouped-query attention in one sdpa call on CPU: call it where the engine builds its model
    "grouped_query_sdpa",
    # a mixture-of-experts model's experts per token, recorded while it generates (SamplingParams.return_routed_experts)
    "ROUTED_EXPERTS",
    "recorded_routes",
    "generated_routes",
    "own_routing",
    # prompts in, samples out: (batch, prompt_len) left-padded, (batch, response_len) right-padded
    "left_pad",
    "rollout_batch",
    "samples_batch",
    # sleep/wake tags and their log lines
    "WEIGHTS",
    "KV_CACHE",
    "ALL_MEMORY",
    "sleep_skipped",
    "log_once",
    # weight updates: checked before they reach the engine, in buckets
    "prepare_update",
    "engine_weights",
    "checkpoint_names",
    "DEFAULT_PACKED",
    "WeightSyncError",
    "WeightBucket",
    "weight_buckets",
    # a verified sync: the digest of a tensor the engine holds (weight_checksums)
    "tensor_digest",
    # the process's random states (python, numpy, torch, CUDA): an engine built in the trainer's process must leave them as found
    "get_rng_state",
    "set_rng_state",
    # the generator an engine samples tokens from when a request has no seed (not torch's default one, which every thread shares)
    "sampling_generator",
]
