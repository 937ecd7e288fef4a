"""A GSM8K answer tool written on verl's own ``BaseTool`` (verl 0.9.1's wheel ships no
``verl.tools.gsm8k_tool``, which verl's multi-turn example names): the answer the model passes is
checked against the row's ground truth (``create_kwargs``), 1.0 when equal, as verl's was."""

from __future__ import annotations

from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

CREATED: list[str] = []  # every instance the rollout created, across the run


class Gsm8kTool(BaseTool):
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self._truth: dict[str, str] = {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._truth[instance_id] = str(ground_truth)
        CREATED.append(instance_id)
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        answer = str(parameters.get("answer", "")).strip()
        right = answer == self._truth[instance_id]
        return ToolResponse(text=f"Current parsed answer={answer!r} result={1.0 if right else 0.0}"), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        self._truth.pop(instance_id, None)
