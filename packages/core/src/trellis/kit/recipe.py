"""What a recipe that trains on its own samples needs beyond ``trellis`` (trellis-algos' ``rl``): stage timing, placement,
padding, rollout helpers, reward figures, a prompt's images, mixture-of-experts routes, a model folder's config."""

from trellis.data import left_pad
from trellis.hf_folder import model_config, text_config
from trellis.interfaces.backend import PROMPT_IMAGES, first_images
from trellis.interfaces.moe import REPLAY_MODES, ROUTED_EXPERTS, expert_counts, mark_replay, without_replay
from trellis.interfaces.rollout import RolloutFn, engine_devices, pad_id, stop_ids
from trellis.interfaces.signatures import OBJECTIVE
from trellis.rewards import reward_figures
from trellis.runtime.harness import StageTimer, backend_mesh, controller_class
from trellis.runtime.plan import Plan

__all__ = [
    # a step's stage seconds; the backend's placement (mesh) and the controller class a config names
    "StageTimer",
    "backend_mesh",
    "controller_class",
    # how many actor updates one batch makes (mini-batches x epochs)
    "Plan",
    # token id lists padded on the left
    "left_pad",
    # what a rollout function is; the engines' devices, pad and stop tokens
    "RolloutFn",
    "engine_devices",
    "pad_id",
    "stop_ids",
    # the kind an actor's loss registers as
    "OBJECTIVE",
    # a batch's reward metrics
    "reward_figures",
    # a sample's prompt images, without those a conversation's tools returned
    "PROMPT_IMAGES",
    "first_images",
    # a mixture-of-experts model's routes: the batch field, replayed in training or not, the model's expert counts
    "REPLAY_MODES",
    "ROUTED_EXPERTS",
    "expert_counts",
    "mark_replay",
    "without_replay",
    # a model folder's config.json (its text model's, for a vision-language model)
    "model_config",
    "text_config",
]
