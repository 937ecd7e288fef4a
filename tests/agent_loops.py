"""Test-only agent loops (one where the environment speaks first, one with the classic re-encoding
bug) and the in-process plugin that registers them: ``load_plugins(extra=[("agent_loops",
agent_loops)])`` adds the agent loops ``observation_first`` and ``retokenized`` and the
interaction ``contains_answer``."""

from __future__ import annotations

import dataclasses
import uuid

import trellis
from trellis.interfaces.agents import AgentLoop, Interaction, InteractionTurn, Trajectory
from trellis.interfaces.rollout import Generation
from trellis_multiturn import ChatDeltas
from trellis_multiturn.environment import interaction_name

OBSERVATION = "Observation: 7"
SEEN: list[list[dict]] = []  # the conversations ContainsAnswer scored, in this process


class ObservationFirst(AgentLoop):
    """The environment speaks first: its observation (the row's ``extra_info.observation``, else
    ``OBSERVATION``) follows the prompt as a user turn, then the model answers once and the
    sample's interaction scores that answer (``finish_reason`` ``answered``).

    The prompt ends in the generation prompt, so the environment's tokens (mask 0) close that
    empty model turn, then hold the observation and a new generation prompt, as the chat template
    renders ``[*prompt, {assistant: ""}, {user: observation}]``."""

    def __init__(self, engine, spec, env):
        super().__init__(engine, spec, env)
        self.chat = ChatDeltas(spec.tokenizer, spec.template_kwargs)

    async def sample(self, prompt_ids, raw_prompt, extra_info, params):
        traj = Trajectory(interaction=interaction_name(extra_info, list(self.env.interactions)) or "")
        observation = {"role": "user", "content": extra_info.get("observation", OBSERVATION)}
        traj.add_environment(self.chat.after_model([], [observation]))
        traj.user_turns += 1
        budget = self.settings.response_budget(params.max_new_tokens)
        room = min(params.max_new_tokens, budget - len(traj.response_ids))
        if room <= 0:
            traj.finish = "max_response_tokens"
            return traj
        gen = await self.engine.agenerate(prompt_ids + traj.response_ids, dataclasses.replace(params, max_new_tokens=room))
        traj.add_model(gen)
        traj.finish = "answered"
        interaction = self.env.interactions.get(traj.interaction)
        if interaction is not None:
            answer = {"role": "assistant", "content": self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)}
            instance = uuid.uuid4().hex
            kwargs = {k: v for k, v in (extra_info.get("interaction_kwargs") or {}).items() if k != "name"}
            await interaction.start(instance, **kwargs)
            try:
                turn = await interaction.respond(instance, [*raw_prompt, observation, answer])
            finally:
                await interaction.finalize(instance)
            traj.turn_scores.append(float(turn.score))
        return traj


class Retokenized(AgentLoop):
    """The classic multi-turn bug, on purpose: the model's turn decoded to text and encoded again
    (here with a newline added, as a chat template might), so the trained ids are not the sampled ones."""

    async def sample(self, prompt_ids, raw_prompt, extra_info, params):
        gen = await self.engine.agenerate(prompt_ids, params)
        again = self.tokenizer.encode(self.tokenizer.decode(gen.token_ids, skip_special_tokens=True) + "\n", add_special_tokens=False)
        traj = Trajectory()
        traj.add_model(Generation(again, [-1.0] * len(again), gen.finish_reason))
        traj.finish = "stop"
        return traj


class ContainsAnswer(Interaction):
    """Done and 1.0 when the last message holds ``ground_truth`` (an interaction kwarg, default "46"),
    else 0.0 and "wrong, try again"; records each conversation it scores in ``SEEN``."""

    def __init__(self, options=None):
        super().__init__(options)
        self.answers: dict[str, str] = {}

    async def start(self, instance_id, ground_truth="46", **kwargs):
        self.answers[instance_id] = str(ground_truth)

    async def respond(self, instance_id, messages):
        SEEN.append([dict(m) for m in messages])
        right = self.answers[instance_id] in messages[-1]["content"]
        return InteractionTurn(done=right, message="" if right else "wrong, try again", score=1.0 if right else 0.0)

    async def finalize(self, instance_id):
        del self.answers[instance_id]


@trellis.hookimpl
def trellis_register(registry):
    registry.add("agent_loop", "observation_first", ObservationFirst)
    registry.add("agent_loop", "retokenized", Retokenized)
    registry.add("interaction", "contains_answer", ContainsAnswer)
