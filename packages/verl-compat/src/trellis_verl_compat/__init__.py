"""Trellis for verl users: verl launch configs converted to trellis configs."""
