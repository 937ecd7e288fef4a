"""What a package running the ``rl`` recipe's ``multi_turn`` section (kind ``rollout_function``) needs beyond ``trellis``."""

from trellis.data import renders_tools
from trellis.interfaces.agents import ClassAdapter
from trellis.interfaces.backend import MODEL_INPUTS, PROMPT_IMAGES, join_images
from trellis.interfaces.moe import ROUTED_EXPERTS, batch_routes, conversation_routes
from trellis.interfaces.rollout import pad_id, with_images
from trellis.rewards import reward_figures

__all__ = [
    # a verl class run through an adapter (kind class_adapter: trellis-verl-compat's)
    "ClassAdapter",
    # whether a chat template renders tools
    "renders_tools",
    # the prompt fields an engine reads, a vision-language prompt's images, the pad token
    "MODEL_INPUTS",
    "PROMPT_IMAGES",
    "join_images",
    "with_images",
    "pad_id",
    # a mixture-of-experts model's experts per token, over a conversation's turns
    "ROUTED_EXPERTS",
    "batch_routes",
    "conversation_routes",
    # a batch's reward metrics
    "reward_figures",
]
