"""What a package that serves a model over HTTP needs (the policy endpoint, the judge engine): chat rendering and the OpenAI wire format."""

from trellis.data import encode_text, render_chat, renders_tools
from trellis.openai_api import (
    MODEL,
    ChatRequest,
    Refused,
    assistant_message,
    canonical,
    chat_reply,
    chat_request,
    error_body,
    request_body,
    text_reply,
    text_request,
)

__all__ = [
    # chat messages to text and tokens, as the model's chat template renders them
    "render_chat",
    "renders_tools",
    "encode_text",
    # OpenAI-compatible requests and replies (/v1/chat/completions, /v1/completions); Refused: a 4xx naming the field
    "MODEL",
    "ChatRequest",
    "Refused",
    "request_body",
    "chat_request",
    "text_request",
    "canonical",
    "assistant_message",
    "chat_reply",
    "text_reply",
    "error_body",
]
