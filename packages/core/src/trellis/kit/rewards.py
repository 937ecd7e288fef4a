"""What a reward service of the ``rl`` recipe needs of core beyond ``trellis`` (trellis-judges' reward model): model folder checks,
left padding. Its protocol, context and the ``reward`` section are trellis-algos' (``trellis_algos``)."""

from trellis.data import left_pad
from trellis.recipes.options import check_not_a_run

__all__ = [
    # refuse a run folder or checkpoint given as a model folder, naming the export command
    "check_not_a_run",
    # token id lists as (input_ids, attention_mask, position_ids), padded on the left
    "left_pad",
]
