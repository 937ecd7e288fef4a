"""End-to-end runs: arithmetic data files in verl's schema and recipe runs (tests/recipe_runs.py)."""

from recipe_runs import data_files, run_recipe, run_rl, step_batches  # noqa: F401 - fixtures
