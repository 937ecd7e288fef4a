"""What an agent loop (kind ``agent_loop``) needs beyond ``trellis``: its spec and environment, chat rendering, sampled turns, OpenAI wire format."""

from trellis.data import encode_text, render_chat, renders_tools
from trellis.multiturn.chat import ChatDeltas
from trellis.multiturn.environment import AgentSpec, Environment
from trellis.multiturn.openai_api import (
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
from trellis.multiturn.references import finite_reward, load_reference
from trellis.multiturn.sampled import current_record, record_into

__all__ = [
    # what a loop is built with: the resolved multi_turn section (settings, tokenizer, template kwargs) and its environment
    "AgentSpec",
    "Environment",
    # chat messages to tokens: the template's rendering, environment turns token-exactly after sampled ones
    "render_chat",
    "renders_tools",
    "encode_text",
    "ChatDeltas",
    # the sampled turns of the sample running in this task (checked against its trajectory), and where a server records them
    "current_record",
    "record_into",
    # a user's function named in the config (path/to/file.py:name), and a reward it returns
    "load_reference",
    "finite_reward",
    # OpenAI-compatible requests and replies (/v1/chat/completions, /v1/completions)
    "MODEL",
    "ChatRequest",
    "Refused",
    "chat_request",
    "text_request",
    "request_body",
    "canonical",
    "assistant_message",
    "chat_reply",
    "text_reply",
    "error_body",
]
