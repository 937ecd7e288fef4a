"""A test-only Trellis plugin written against the public API only."""
