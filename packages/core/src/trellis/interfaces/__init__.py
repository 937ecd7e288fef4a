"""Interfaces that plugins implement: training backends, rollout engines, algorithm signatures, multi-turn environments."""
