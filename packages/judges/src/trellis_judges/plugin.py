"""The ``judge`` reward and the reward services ``judge_engine`` (``reward.judge``) and ``reward_model`` (``reward.model``)."""

from __future__ import annotations

import trellis


@trellis.hookimpl
def trellis_register(registry):
    from trellis_judges.client import judge_score
    from trellis_judges.engine import JudgeEngine
    from trellis_judges.reward_model import RewardModel

    registry.add("reward", "judge", judge_score)
    registry.add("reward_service", "judge_engine", JudgeEngine)
    registry.add("reward_service", "reward_model", RewardModel)
