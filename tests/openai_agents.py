"""Test agents written against the ``openai`` client as a user would write them, for
``multi_turn.agent=<this file>:<function>``: ``answer_then_follow_up`` asks the policy, then asks
again after a follow-up question, and returns a reward from the second answer."""

from __future__ import annotations

from trellis_demo.tool_call import ADD  # the agent's own tool, declared to the run by its schema alone

FOLLOW_UP = "again?"


async def answer_then_follow_up(client, sample):
    messages = list(sample.messages)
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": FOLLOW_UP}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_completion_tokens=5)
    return len(second.choices[0].message.content) / 10  # varies between samples: a group-relative signal


def not_async(client, sample):
    return 1.0


async def raises(client, sample):
    await client.chat.completions.create(model="policy", messages=sample.messages)
    raise RuntimeError("the agent's own bug")


async def returns_none(client, sample):
    """Forgets to return its reward: every sample fails."""
    await client.chat.completions.create(model="policy", messages=sample.messages)


async def sleeps(client, sample):
    import asyncio

    await client.chat.completions.create(model="policy", messages=sample.messages)
    await asyncio.sleep(60)
    return 1.0


async def three_turns(client, sample):
    """Asks three times; the third call is past multi_turn.max_assistant_turns=2 and refused."""
    import openai

    messages = list(sample.messages)
    for _ in range(3):
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
        except openai.BadRequestError as exc:
            return 0.5 if "model turns (multi_turn.max_assistant_turns)" in exc.message else -1.0
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": FOLLOW_UP}]
    return -1.0


async def closes_its_client(client, sample):
    """Closes its client after one call (``async with``), then calls again: the samples' clients
    share one connection pool, which an agent's close leaves open."""
    async with client:
        await client.chat.completions.create(model="policy", messages=sample.messages, max_tokens=3)
    await client.models.list()
    return 1.0


async def runs_its_own_add(client, sample):
    """Offers its own ``add`` through the tool-calling API, runs the calls itself, sends the
    results back and is rewarded for the final answer."""
    import json

    messages = list(sample.messages)
    reply = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
    message = reply.choices[0].message
    messages.append(message)
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])})
    final = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
    return float(final.choices[0].message.content == "#### 46")


async def says_where_it_runs(client, sample):
    """``answer_then_follow_up``, then writes its process id, endpoint address and reward to the
    file the row's ``extra_info.log`` names (the test cannot look inside a Ray rank)."""
    import json
    import os

    reward = await answer_then_follow_up(client, sample)
    with open(sample.extra_info["log"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "base_url": str(client.base_url), "reward": reward}) + "\n")
    return reward


async def raises_before_asking(client, sample):
    """Fails before the model writes a token (e.g. a tool it needs is down)."""
    raise RuntimeError("the agent's database is down")
