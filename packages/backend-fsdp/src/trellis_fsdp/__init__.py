"""FSDP2 training backend for Trellis."""
