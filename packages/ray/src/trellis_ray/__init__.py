"""Trellis on Ray: the ``ray`` controller, its rollout pools and weight transports."""
