"""Hugging Face transformers rollout for Trellis."""
