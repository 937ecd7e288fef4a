"""The runtime every recipe shares: controllers and dispatch, role workers, checkpoints, trackers, the run harness."""
