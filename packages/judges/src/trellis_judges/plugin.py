"""The ``judge`` reward and the ``judge_engine`` reward service (``reward.judge``), registered by entry point."""

from __future__ import annotations

import trellis


@trellis.hookimpl
def trellis_register(registry):
    from trellis_judges.client import judge_score
    from trellis_judges.engine import JudgeEngine

    registry.add("reward", "judge", judge_score)
    registry.add("reward_service", "judge_engine", JudgeEngine)
