"""What a training backend (kind ``backend``) needs: its interface, the optimizer, HF model helpers, the process group, RNG state,
an adapter's base model fingerprint."""

from trellis.interfaces.backend import (
    ADAPTER_VERBS,
    IMAGE_INPUTS,
    MODEL_INPUTS,
    OUTPUTS,
    Backend,
    BackendSpec,
    DistInfo,
    LossFn,
    WeightBucket,
    backward_each,
    weight_buckets,
)
from trellis.interfaces.dispatch import RANK0, Mesh, Route
from trellis.interfaces.hf import (
    RESPONSE_OUTPUTS,
    empty_hf_model,
    forward_outputs,
    keep_buffers,
    load_hf_model,
    response_outputs,
    value_outputs,
    vision_tower,
)
from trellis.interfaces.moe import MOE_OUTPUTS, ROUTED_EXPERTS, expert_counts
from trellis.interfaces.optim import IMPLEMENTATIONS, clipped_step, lr_factor, make_optimizer, schedule_step
from trellis.interfaces.process_group import device_for, join_process_group, leave_process_group
from trellis.rng import get_rng_state, set_rng_state
from trellis.runtime.checkpoint import ADAPTER_BASE_FILE, base_fingerprint

__all__ = [
    # the interface and where a rank sits
    "Backend",
    "BackendSpec",
    "DistInfo",
    "Mesh",
    "LossFn",
    "OUTPUTS",
    "MODEL_INPUTS",
    "IMAGE_INPUTS",
    # a mixture-of-experts policy's recorded routes (replayed by forward_outputs) and its router outputs
    "ROUTED_EXPERTS",
    "MOE_OUTPUTS",
    "expert_counts",
    # verbs a backend serves beyond the role worker's (Backend.verbs), and how each is dealt over the ranks
    "Route",
    "RANK0",
    "ADAPTER_VERBS",
    # forward/backward and weight export
    "backward_each",
    "WeightBucket",
    "weight_buckets",
    # Hugging Face models
    "load_hf_model",
    "vision_tower",
    "empty_hf_model",
    "keep_buffers",
    "forward_outputs",
    "value_outputs",
    # a backend's own layout of a micro-batch: the response outputs from the logits it gathered
    "RESPONSE_OUTPUTS",
    "response_outputs",
    # the optimizer
    "IMPLEMENTATIONS",
    "make_optimizer",
    "lr_factor",
    "schedule_step",
    "clipped_step",
    # the process group and checkpointed RNG state
    "join_process_group",
    "leave_process_group",
    "device_for",
    "get_rng_state",
    "set_rng_state",
    # what an adapter role's checkpoint records of its base model
    "ADAPTER_BASE_FILE",
    "base_fingerprint",
]
