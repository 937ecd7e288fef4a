"""Trellis judges: an LLM judge as a reward (``judge``, over any OpenAI-compatible endpoint) and a judge
model the ``rl`` recipe serves itself (``reward.judge``, reward service ``judge_engine``)."""
