"""What the ``rl`` recipe runs with ``multi_turn.enable=true`` (kind ``rollout_function``, name
``multi_turn``): the section's checks, and the conversations of the rows it reads."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from trellis import PromptEncoder, Registry
from trellis_algos import PromptDataset, PromptLoader, load_prompt_data
from trellis_multiturn.checks import check_multi_turn
from trellis_multiturn.environment import agent_spec
from trellis_multiturn.rollout import AGENT_COLUMN, AgentRollout, agent_rollout


class MultiTurn:
    """``trellis_algos.MultiTurnRunner`` for conversations through agent loops."""

    def check(self, cfg: DictConfig, registry: Registry) -> None:
        check_multi_turn(cfg, registry)

    def load(
        self, cfg: DictConfig, registry: Registry, tokenizer: Any, encoder: PromptEncoder | None
    ) -> tuple[AgentRollout, PromptLoader, PromptDataset | None]:
        spec = agent_spec(cfg.multi_turn, registry, tokenizer)
        spec.images = encoder  # renders the images tools return; the loops used must take images
        spec.max_prompt_length = cfg.data.max_prompt_length
        train, val = load_prompt_data(cfg.data, tokenizer, cfg.seed, spec.template_kwargs, encoder)
        names = {
            f"data.{key} {cfg.data[key]!r}": [(item["index"], item[AGENT_COLUMN]) for item in dataset.items]
            for key, dataset in (("train_path", train.dataset), ("val_path", val))
            if dataset is not None
        }
        return agent_rollout(spec, registry, names), train, val
