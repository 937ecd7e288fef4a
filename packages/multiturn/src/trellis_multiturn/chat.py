"""Token-exact turns: the environment's messages as chat-template token deltas that follow the
model's own tokens, which are never decoded and re-encoded."""

from __future__ import annotations

from typing import Any

from trellis import encode_text, render_chat

# A conversation that ends in an assistant turn; deltas are what the template adds after it.
_USER, _ASSISTANT = "\x00trellis-user\x00", "\x00trellis-assistant\x00"
_BASE = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]


class ChatDeltas:
    """Renders environment turns (user feedback, tool results) as token ids to append after a
    model turn.

    A model turn ends with the stop token it sampled (e.g. ``<|im_end|>``), or nowhere when it ran
    out of tokens. The chat template closes an assistant turn with some text after its content
    (``<|im_end|>\\n`` in ChatML); the delta starts with whatever of that closing the model did not
    generate itself, then the new messages, then the generation prompt for the next model turn.
    """

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(template_kwargs or {})
        self.base = render_chat(tokenizer, _BASE, False, self.kwargs)
        if _ASSISTANT not in self.base:
            raise ValueError("the chat template drops the assistant's content; multi-turn rollouts need a template that renders it")
        self.closing = self.base[self.base.rindex(_ASSISTANT) + len(_ASSISTANT) :]

    def after_model(self, model_ids: list[int], messages: list[dict[str, Any]]) -> list[int]:
        """Token ids that follow the model turn ``model_ids``: the rest of its closing, ``messages``
        rendered, and the generation prompt."""
        return encode_text(self.tokenizer, self.text_after_model(model_ids, messages))

    def text_after_model(self, model_ids: list[int], messages: list[dict[str, Any]]) -> str:
        """:meth:`after_model` as text, before tokenizing (a turn with images has its placeholders expanded first)."""
        full = render_chat(self.tokenizer, _BASE + list(messages), True, self.kwargs)
        if not full.startswith(self.base):
            raise ValueError("the chat template renders earlier turns differently once more follow; cannot append turns token-exactly")
        return self._closing_rest(model_ids) + full[len(self.base) :]

    def sampled_closing(self, model_ids: list[int]) -> str:
        """The start of the template's closing that the model turn sampled itself (its stop
        token's text, e.g. ``<|im_end|>``); "" when the turn was cut short or stopped otherwise."""
        if model_ids:
            last = self.tokenizer.decode([model_ids[-1]])
            if last and self.closing.startswith(last):
                return last
        return ""

    def _closing_rest(self, model_ids: list[int]) -> str:
        return self.closing[len(self.sampled_closing(model_ids)) :]  # the environment closes the rest
