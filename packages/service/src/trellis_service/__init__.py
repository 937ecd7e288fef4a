"""Trellis as a training service: the Tinker API over trellis backends and engines (``trellis serve``)."""
