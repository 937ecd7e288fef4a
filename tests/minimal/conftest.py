"""Runs on the minimal install: arithmetic data files and recipe runs (tests/recipe_runs.py)."""

from recipe_runs import data_files, run_recipe, run_rl  # noqa: F401 - fixtures
