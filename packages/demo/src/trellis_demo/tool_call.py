"""A tiny model taught to answer an arithmetic question with one ``add`` tool call, then the answer
after the tool's result: a model that writes tool calls (a random one never does), for the agent
bench and tests."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
    },
}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 34}}</tool_call>'
RESULT = "46"
ANSWER = "#### 46"


def make_tool_calling_model(out_dir: str | os.PathLike, rows: Sequence[dict[str, Any]], steps: int = 80, seed: int = 0) -> str:
    """A tiny model (``trellis_demo.tiny``, chat template with tools) trained by SFT on one
    episode per row of ``rows`` (verl-schema prompts rendered with ``ADD``): ``CALL``, the tool's
    ``RESULT``, ``ANSWER``, until greedy decoding plays it. Returns the saved folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trellis import encode_text
    from trellis_algos import PromptDataset
    from trellis_demo.tasks import task_texts
    from trellis_demo.tiny import TOOLS_CHAT_TEMPLATE, make_tiny_model
    from trellis_multiturn import ChatDeltas  # the model is for conversations, which need trellis-multiturn

    out = Path(out_dir)
    texts = [*task_texts(), json.dumps(ADD), CALL, "Tools:\ntool\n"]
    base = make_tiny_model(out / "base", texts * 4, hidden_size=32, num_layers=2, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
    prompts = PromptDataset(rows, tokenizer, 512, chat_template_kwargs={"tools": [ADD]}).as_batch()

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    call = encode_text(tokenizer, CALL) + [tokenizer.eos_token_id]
    result = ChatDeltas(tokenizer, {"tools": [ADD]}).after_model(call, [{"role": "tool", "content": RESULT}])
    answer = encode_text(tokenizer, ANSWER) + [tokenizer.eos_token_id]
    episode, trained = call + result + answer, call + [-100] * len(result) + answer
    starts = [prompts["input_ids"][i][prompts["attention_mask"][i].bool()].tolist() for i in range(len(prompts))]
    width = max(map(len, starts)) + len(episode)
    pad = [tokenizer.pad_token_id] * width
    ids = torch.tensor([(r + episode + pad)[:width] for r in starts])
    mask = torch.tensor([[1] * (len(r) + len(episode)) + [0] * (width - len(r) - len(episode)) for r in starts])
    labels = torch.tensor([([-100] * len(r) + trained + [-100] * width)[:width] for r in starts])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out / "taught")
    tokenizer.save_pretrained(out / "taught")
    return str(out / "taught")
