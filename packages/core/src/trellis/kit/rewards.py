"""What a reward service of the ``rl`` recipe needs beyond ``trellis`` (trellis-judges' reward model): its context, folders, tokenizers, inputs."""

from trellis.data import left_pad
from trellis.recipes.options import check_not_a_run
from trellis.rewards import RESERVED_KEYS, ServiceContext

__all__ = [
    # what a reward service is started with (registry, seed, the run to spawn a role on, its config, the policy's tokenizer)
    "ServiceContext",
    # the reward/ metric names a component's key must not take
    "RESERVED_KEYS",
    # refuse a run folder or checkpoint given as a model folder, naming the export command
    "check_not_a_run",
    # token id lists as (input_ids, attention_mask, position_ids), padded on the left
    "left_pad",
]
