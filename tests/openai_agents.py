"""Test agents written against the ``openai`` client as a user would write them, for
``multi_turn.agent=<this file>:<function>``: ``answer_then_follow_up`` asks the policy, then asks
again after a follow-up question, and returns a reward from the second answer."""

from __future__ import annotations

FOLLOW_UP = "again?"


async def answer_then_follow_up(client, sample):
    messages = list(sample.messages)
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": FOLLOW_UP}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_completion_tokens=5)
    return len(second.choices[0].message.content) / 10  # varies between samples: a group-relative signal


def not_async(client, sample):
    return 1.0
