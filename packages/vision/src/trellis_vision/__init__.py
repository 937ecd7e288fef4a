"""Trellis vision: image prompts for vision-language models."""
