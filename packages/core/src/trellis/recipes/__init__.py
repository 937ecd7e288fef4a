"""Recipes (the training loops shipped with core) and the options of their sections."""
