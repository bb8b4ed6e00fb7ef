"""Causal depthwise conv1d with prefill checkpoints of its raw-input state; see README.md for the conventions."""
