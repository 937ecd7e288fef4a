"""A reward model's own inputs for a rollout batch when its tokenizer differs from the policy's:
each sample's conversation re-rendered with the reward model's chat template and re-tokenized,
in the layout the ``rm`` recipe trains on."""

from __future__ import annotations

import logging
from typing import Any

from trellis import Batch, encode_response, encode_text, last_valid_index, render_chat, require_pad_id
from trellis.kit.rewards import left_pad
from trellis_algos import tokenizer_difference

logger = logging.getLogger("trellis")


def retokenize_reason(policy: Any, reward: Any) -> str:
    """Why the reward model cannot score the policy's token ids as they are ('' when it can): the
    tokenizers differ in vocabulary (a token string with another id, or missing) or special
    tokens, or their chat templates differ (the reward model was trained on its own rendering)."""
    differ = tokenizer_difference(policy, reward)
    if differ:
        return differ
    if getattr(policy, "chat_template", None) != getattr(reward, "chat_template", None):
        return "chat templates"
    return ""


class RewardInputs:
    """``inputs(batch) -> Batch``: ``input_ids``, ``attention_mask``, ``position_ids`` ``(batch,
    seq_len)``, left-padded, for the reward model, from a rollout ``batch`` (its ``raw_prompt``
    chat messages, ``responses`` and ``response_mask`` ``(batch, response_len)``).

    Each sample becomes the reward model's chat template over the row's messages with the
    generation prompt, then the response's text (the policy's tokens decoded without special
    tokens) and, when the response ended with the policy's eos token, the reward model's eos
    token: the layout the ``rm`` recipe trains on (trellis-algos' ``pairs``), so its score is
    read at the answer's end. A sample longer than ``max_length`` tokens keeps its last
    ``max_length`` (the prompt's start is cut, never the answer's end), with one warning that
    counts them per batch."""

    def __init__(self, policy: Any, reward: Any, max_length: int, conversation: bool = False) -> None:
        self.policy, self.reward, self.max_length, self.conversation = policy, reward, max_length, conversation
        self.pad = require_pad_id(reward)

    def sample(self, messages: list[dict[str, Any]], response: list[int]) -> list[int]:
        """One sample's token ids for the reward model (uncut); with ``conversation``, the messages
        and the response as an assistant message, rendered whole (``reward.model.layout``)."""
        text = self.policy.decode(response, skip_special_tokens=True)
        if self.conversation:
            return encode_text(self.reward, render_chat(self.reward, [*messages, {"role": "assistant", "content": text}], False, {}))
        prompt = encode_text(self.reward, render_chat(self.reward, list(messages), True, {}))
        finished = bool(response) and response[-1] == self.policy.eos_token_id
        return prompt + (encode_response(self.reward, text) if finished else encode_text(self.reward, text))

    def __call__(self, batch: Batch) -> Batch:
        if "raw_prompt" not in batch:
            raise ValueError(
                "the reward model's tokenizer differs from the policy's, so it scores each sample's conversation re-rendered "
                "with its own chat template, which needs the rows' chat messages (field 'raw_prompt'); this batch has "
                f"only {sorted(batch.keys())}"
            )
        mask = batch["response_mask"].bool()
        ends = last_valid_index(mask) + 1
        seqs = [self.sample(messages, batch["responses"][i, : ends[i]].tolist()) for i, messages in enumerate(batch["raw_prompt"])]
        long = [len(s) for s in seqs if len(s) > self.max_length]
        if long:
            logger.warning(
                "%d of %d samples are longer than the reward model's %d tokens (longest %d): their prompts' starts were cut "
                "for scoring", len(long), len(seqs), self.max_length, max(long),
            )  # fmt: skip
        input_ids, attention_mask, position_ids = left_pad([s[-self.max_length :] for s in seqs], self.pad)
        return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids})
