"""The vLLM rollout under Ray: built in the actor's rank process beside FSDP, and in an engine
process of its own fed by a weight transport, also a step ahead of training (vLLM reports no
digests: the probe checks each sync)."""

from __future__ import annotations

from engine_cases import OnRayCases


class TestVLLMOnRay(OnRayCases):
    ENGINE_KEYS = ("rollout.name=vllm", "rollout.max_model_len=128")
