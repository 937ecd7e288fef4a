"""What a package's recipe needs beyond ``trellis`` to read its own rows: dotted columns, images, the prompt encoder."""

from trellis.data import has_images, image_field, refuse_images, row_value
from trellis.recipes.options import prompt_images

__all__ = [
    # a row's column by dotted name (extra_info.answer)
    "row_value",
    # a row's images: whether it has any, a text model's refusal, a batch's image field from a prompt encoder's items
    "has_images",
    "refuse_images",
    "image_field",
    # the prompt encoder of a vision-language model (trellis-vision's), None for a text model
    "prompt_images",
]
