"""Mamba2 SSD (state space duality) scan with prefill checkpoints; see README.md for the recurrence and conventions."""
