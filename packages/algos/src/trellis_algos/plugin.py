"""The trellis-algos plugin: registers every estimator and loss of this package by name."""

from __future__ import annotations

from trellis import hookimpl
from trellis_algos import advantages, distill, distill_losses, kl, objectives, policy_losses, preference, sft_losses, token_baseline
from trellis_algos.rewards import auto_score, gsm8k_score, math_score
from trellis_algos.rl import RLRecipe
from trellis_algos.rl.dynamic_sampling import group_has_signal
from trellis_algos.rm import RMRecipe
from trellis_algos.sft import SFTRecipe
from trellis_algos.spin import SPINRecipe


@hookimpl
def trellis_register(registry):
    """Add kinds ``advantage``, ``policy_loss``, ``kl``, ``sft_loss``, ``preference_loss``,
    ``distill_loss`` and ``objective``, the recipes ``rl``, ``sft``, ``spin`` and ``rm``, and the ``rl``
    recipe's group filter ``zero_variance``, and the rule rewards ``gsm8k``, ``math`` and ``auto``."""
    for kind, table in (
        ("advantage", advantages.ESTIMATORS),
        ("advantage", token_baseline.ESTIMATORS),
        ("advantage", distill.ESTIMATORS),
        ("policy_loss", policy_losses.LOSSES),
        ("sft_loss", sft_losses.LOSSES),
        ("preference_loss", preference.LOSSES),
        ("distill_loss", distill_losses.LOSSES),
    ):
        for name, (fn, options) in table.items():
            registry.add(kind, name, fn, options=options)
    for name, fn in kl.ESTIMATORS.items():
        registry.add("kl", name, fn, options=None)
    for name, factory in objectives.OBJECTIVES.items():
        registry.add("objective", name, factory, options=None)
    registry.add("recipe", "rl", RLRecipe(), options=RLRecipe.Config)
    registry.add("group_filter", "zero_variance", group_has_signal)
    registry.add("reward", "gsm8k", gsm8k_score)
    registry.add("reward", "math", math_score)
    registry.add("reward", "auto", auto_score)
    registry.add("recipe", "sft", SFTRecipe(), options=SFTRecipe.Config)
    registry.add("recipe", "spin", SPINRecipe(), options=SPINRecipe.Config)
    registry.add("recipe", "rm", RMRecipe(), options=RMRecipe.Config)
