"""Trellis Megatron-Core backend."""
