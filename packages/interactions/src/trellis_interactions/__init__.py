"""Interactions for multi-turn RL (kind ``interaction``)."""
