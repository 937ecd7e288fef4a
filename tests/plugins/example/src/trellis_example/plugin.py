"""Registers one small, working component of each kind; the core tests use them by name."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from omegaconf import MISSING

import trellis
from trellis import Aggregation, Backend, Batch, Interaction, InteractionTurn, RolloutEngine, Tool, ToolResult, Tracker, component
from trellis.kit.controller import LocalController


@dataclass
class ScaledOptions:
    scale: float = 1.0


def scaled_reward_advantage(data, options: ScaledOptions):
    """Advantage = scale * sequence reward on every valid token."""
    adv = options.scale * data.token_rewards.sum(-1, keepdim=True) * data.response_mask
    return adv, adv


def reinforce_loss(data, agg, options):
    loss = -(data.advantages * data.log_prob * data.response_mask).sum() / data.response_mask.sum()
    return loss, {"pg_loss": float(loss)}


def diff_kl(log_prob, ref_log_prob):
    return log_prob - ref_log_prob


def nll_loss(token_log_probs, loss_mask, agg, options):
    loss = -(token_log_probs * loss_mask).sum() / loss_mask.sum()
    return loss, {"loss": float(loss)}


def margin_loss(data, options):
    loss = -torch.nn.functional.logsigmoid((data.chosen - data.rejected) - (data.ref_chosen - data.ref_rejected)).mean()
    return loss, {"loss": float(loss)}


def squared_gap(student, teacher, options):
    """A distillation divergence: the squared gap between the two log-probs, summed over buckets."""
    return ((student - teacher.detach()) ** 2).sum(-1)


class LikelihoodObjective:
    """Maximise the responses' summed log-prob, averaged over the mini-batch's samples."""

    outputs = ("log_probs",)
    inputs = ("responses", "response_mask")
    summed = frozenset({"loss"})

    def __init__(self, options, registry):
        pass

    def rows(self, batch):
        return batch

    def counts(self, batch):
        return Aggregation(global_seqs=float(len(batch)))

    def loss(self, micro, outputs, agg):
        loss = -(outputs["log_probs"] * micro["response_mask"]).sum() / agg.global_seqs
        return loss, {"loss": float(loss)}


def length_reward(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) == int(ground_truth))


@dataclass
class SomeRightOptions:
    above: float = trellis.ranged(0.0)  # a kept group has a sample scoring above this


def some_right(values, groups, options):
    """A group filter with options: keep the prompt groups with at least one sample above
    ``options.above`` ``(groups,)``."""
    best = torch.full((int(groups.max()) + 1,), float("-inf")).scatter_reduce(0, groups, values.float(), "amax")
    return best > options.above


class CountingBackend(Backend):
    """Forwards return zeros; counts them (tests check routing through the controller)."""

    def __init__(self, spec):
        self.spec, self.calls = spec, 0

    def build(self):
        self.built = True

    def forward(self, micros, outputs):
        self.calls += 1
        return [{k: torch.zeros_like(m["responses"], dtype=torch.float) for k in outputs} for m in micros]


class EchoRollout(RolloutEngine):
    """Responds with the prompt's tokens reversed."""

    def __init__(self, spec):
        self.spec = spec

    def generate(self, prompts, params):
        flipped = prompts["input_ids"].flip(-1)
        out = Batch({"responses": flipped, "response_mask": torch.ones_like(flipped)})
        return out.repeat_interleave(params.n)

    def load_weights(self, weights, shapes=None):
        self.loaded = list(weights)


class EchoInteraction(Interaction):
    async def respond(self, instance_id, messages):
        return InteractionTurn(done=True, message="", score=1.0)


class AddTool(Tool):
    schema = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}

    async def execute(self, instance_id, arguments):
        return ToolResult(text=str(arguments["a"] + arguments["b"]))


class CallLineParser(trellis.ToolCallParser):
    """Calls written one a line as ``CALL <name> <json arguments>``."""

    def parse(self, text):
        calls = []
        for line in text.splitlines():
            if line.startswith("CALL "):
                name, _, arguments = line[5:].partition(" ")
                calls.append(trellis.ToolCall(name, json.loads(arguments or "{}")))
        return calls


class OneTurnLoop(trellis.AgentLoop):
    """One model turn and no environment: a single-turn sample through the agent loop."""

    async def sample(self, prompt_ids, raw_prompt, extra_info, params):
        traj = trellis.Trajectory()
        traj.add_model(await self.engine.agenerate(prompt_ids, params))
        traj.finish = "stop"
        return traj


class ListTracker(Tracker):
    logged: list = []

    def __init__(self, run_dir, total_steps):
        pass

    def log(self, step, metrics):
        ListTracker.logged.append((step, metrics))


@dataclass
class EchoData:
    path: str = MISSING
    max_prompt_length: int = 16


@dataclass
class EchoTrainer:
    total_steps: int = 2
    lr: float = 1e-3
    run_dir: str | None = None
    trackers: list[str] = field(default_factory=lambda: ["jsonl"])


@dataclass
class EchoConfig:
    recipe: str = "example_echo"
    seed: int = 0
    data: EchoData = field(default_factory=EchoData)
    trainer: EchoTrainer = field(default_factory=EchoTrainer)
    advantage: dict = component("advantage", "example_scaled", scale=2.0)


class EchoRecipe:
    """Writes its resolved config's advantage section and logs two steps of fake metrics."""

    Config = EchoConfig

    def run(self, cfg, ctx):
        trackers = [ctx.registry.get("tracker", t).obj(ctx.run_dir, cfg.trainer.total_steps) for t in cfg.trainer.trackers]
        for step in range(1, cfg.trainer.total_steps + 1):
            for t in trackers:
                t.log(step, {"loss": 1.0 / step})
            ctx.hook.trellis_step_end(step=step, metrics={"loss": 1.0 / step})
        for t in trackers:
            t.close()
        (ctx.run_dir / "advantage.json").write_text(json.dumps(dict(cfg.advantage)))
        return {"steps": cfg.trainer.total_steps}


class CountingController(LocalController):
    """The local controller that counts the roles it builds (a controller is a component like any other)."""

    spawned: list[str] = []

    def spawn(self, role, make_worker, mesh=None):
        CountingController.spawned.append(role)
        return super().spawn(role, make_worker, mesh)


class ScoredBatches:
    """A reward service (wanted by runs rewarded with ``example_length``): counts the batches and
    samples the run's scorer scored, logged as ``example/scored_batches`` and ``example/scored_samples``."""

    @classmethod
    def wanted(cls, reward):
        return reward.name == "example_length" and not reward.terms

    @classmethod
    def check(cls, cfg, registry):
        pass

    @classmethod
    def served(cls, reward):
        return []  # it answers no reward source: it watches the scorer

    def __init__(self, reward, context):
        self.reward, self.batches, self.samples = reward, 0, 0

    def wrap(self, scorer):
        service = self

        class Counted:
            def score(self, batch):
                result = scorer.score(batch)
                service.batches, service.samples = service.batches + 1, service.samples + len(batch)
                return result._replace(metrics={**result.metrics, "example/scored_batches": service.batches,
                                                "example/scored_samples": service.samples})  # fmt: skip

        return Counted()

    def close(self):
        pass


class MarkedPrompts:
    """A prompt encoder: the chat template's text with a marker token after it, and no images."""

    def __init__(self, model_path, tokenizer, data):
        self.tokenizer = tokenizer

    def encode(self, messages, row, where, template_kwargs):
        ids = trellis.encode_text(self.tokenizer, trellis.render_chat(self.tokenizer, messages, True, template_kwargs))
        return [*ids, self.tokenizer.eos_token_id], None

    def model_inputs(self, kept):
        return {}


def json_lines_dataset(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@trellis.hookimpl
def trellis_register(registry):
    registry.add("backend", "example_counting", CountingBackend)
    registry.add("rollout", "example_echo", EchoRollout)
    registry.add("advantage", "example_scaled", scaled_reward_advantage, options=ScaledOptions)
    registry.add("policy_loss", "example_reinforce", reinforce_loss)
    registry.add("kl", "example_diff", diff_kl)
    registry.add("sft_loss", "example_nll", nll_loss)
    registry.add("preference_loss", "example_margin", margin_loss)
    registry.add("distill_loss", "example_squared_gap", squared_gap)
    registry.add("objective", "example_likelihood", LikelihoodObjective)
    registry.add("reward", "example_length", length_reward)
    registry.add("interaction", "example_echo", EchoInteraction)
    registry.add("tool", "example_add", AddTool)
    registry.add("tool_parser", "example_call_line", CallLineParser)
    registry.add("agent_loop", "example_one_turn", OneTurnLoop)
    registry.add("group_filter", "example_some_right", some_right, options=SomeRightOptions)
    registry.add("tracker", "example_list", ListTracker)
    registry.add("controller", "example_counting", CountingController)
    registry.add("reward_service", "example_scored_batches", ScoredBatches)
    registry.add("recipe", "example_echo", EchoRecipe(), options=EchoConfig)
    registry.add("dataset", "example_jsonl", json_lines_dataset)
    registry.add("prompt_encoder", "example_marked", MarkedPrompts)


steps_seen: list[int] = []


@trellis.hookimpl
def trellis_step_end(step):
    steps_seen.append(step)
