"""An interaction and a tool written the way verl's are (``BaseInteraction`` / ``BaseTool``
method names, arguments and return shapes), without verl: the adapters must run them unchanged."""

from __future__ import annotations

from uuid import uuid4

CALLS: list[tuple[str, str]] = []


class VerlStyleInteraction:
    def __init__(self, config):
        self.config = config
        self.name = config.get("name", "interaction_agent")
        self._truth: dict[str, str] = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = instance_id or str(uuid4())
        CALLS.append(("start", instance_id))
        self._truth[instance_id] = ground_truth
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        CALLS.append(("respond", instance_id))
        right = f"#### {self._truth[instance_id]}" in messages[-1]["content"]
        return right, "" if right else self.config["feedback"], 1.0 if right else 0.0, {"right": right}

    async def calculate_score(self):
        return 0.0

    async def finalize_interaction(self, instance_id, **kwargs):
        CALLS.append(("finalize", instance_id))
        del self._truth[instance_id]


class VerlStyleTool:
    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name
        assert tool_schema.model_dump()["function"]["name"] == self.name

    async def create(self, instance_id=None, **kwargs):
        CALLS.append(("create", instance_id))
        return instance_id, {"text": ""}

    async def execute(self, instance_id, parameters, **kwargs):
        CALLS.append(("execute", instance_id))
        a, b = parameters["expr"].split("+")
        return {"text": str(int(a) + int(b))}, 0.25, {"calls": 1}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        CALLS.append(("release", instance_id))
