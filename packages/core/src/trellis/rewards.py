"""What a reward is to a recipe: the result of scoring a batch (:class:`RewardResult`), whatever
scores it (:class:`Scorer`), the error a reward raises, and a user's function loaded from a ``.py`` file.

A reward function (kind ``reward``) has verl's signature ``compute_score(data_source,
solution_str, ground_truth, extra_info, **kwargs) -> float | dict`` (a dict holds ``score``; its
other numbers become metrics ``reward/<key>``), or is an ``async def`` of it. The reward manager
that calls them, the ``reward`` section and the rule rewards (``gsm8k``, ``math``, ``auto``) are
trellis-algos' (``trellis_algos.rewards``).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, Protocol

import torch

from trellis.batch import Batch


class RewardError(RuntimeError):
    """A reward function could not be found, called or trusted; the message says which and why."""


def load_function(path: str | Path, name: str, keys: tuple[str, str] = ("reward.path", "reward.name")) -> Callable[..., Any]:
    """Function ``name`` from the Python file ``path``; errors name the file, what it defines and
    the config ``keys`` that gave the path and the name."""
    path = Path(path)
    path_key, name_key = keys
    if not path.is_file():
        raise RewardError(f"{path_key} {str(path)!r} does not exist; give the path of a .py file that defines {name!r}")
    resolved = path.resolve()
    try:
        module = _user_module(str(resolved), resolved.stat().st_mtime_ns, path_key)
    except _NotPython:
        raise RewardError(f"{path_key} {str(path)!r} cannot be imported as Python; give a .py file") from None
    except Exception as exc:
        raise RewardError(f"{path_key} {str(path)!r} failed to import: {type(exc).__name__}: {exc}") from exc
    module_name = module.__name__
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module_name)
        what = "is not callable" if fn is not None else "is not defined there"
        raise RewardError(f"{name_key} {name!r} {what} in {str(path)!r}; functions found: {', '.join(found) or 'none'}; set {name_key}")
    return fn


class _NotPython(Exception):
    """The file is no Python module importlib can load."""


@cache
def _user_module(resolved: str, mtime_ns: int, path_key: str) -> ModuleType:
    """The module of a user's Python file, run once per process and version of the file: the config
    check, the reward manager and a judge engine all read it, and its top level (a model loaded, a
    line printed) must not run once for each. Raises what the file's top level raises (not cached:
    a failed import runs again at the next call)."""
    module_name = f"trellis_user_{path_key.split('.')[0]}_{abs(hash(resolved))}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise _NotPython(resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


# -- manager ---------------------------------------------------------------------------------------
class RewardResult(NamedTuple):
    """token_scores: ``(batch, response_len)`` float, the score on each response's last valid token.
    metrics: ``reward/mean``, ``reward/max``, ``reward/min``, ``reward/errors``, ``reward/error_rate``
    (errors / samples), ``reward/<key>``.
    scores: ``(batch,)`` float, the per-sample scores (also for empty responses, whose token row is 0).
    components: ``{key: (batch,) float}``, every other number a reward's dict returned, per sample
    (0 for a sample that did not return the key); None when not computed."""

    token_scores: torch.Tensor
    metrics: dict[str, float]
    scores: torch.Tensor
    components: dict[str, torch.Tensor] | None = None


class Scorer(Protocol):
    """What a run's reward is to the recipe, whatever scores it (the reward functions, a reward
    model, a served judge, a conversation's environment)."""

    def score(self, batch: Batch) -> RewardResult:
        """The reward of every sample of ``batch`` (rollout layout)."""


def reward_figures(scores: torch.Tensor) -> dict[str, float]:
    """``reward/mean|max|min`` of the samples' scores ``(batch,)`` (0 for none)."""
    if not len(scores):
        return {"reward/mean": 0.0, "reward/max": 0.0, "reward/min": 0.0}
    return {"reward/mean": float(scores.mean()), "reward/max": float(scores.max()), "reward/min": float(scores.min())}
