"""Test-only Trellis plugin package."""
