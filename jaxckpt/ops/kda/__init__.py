"""Kimi Delta Attention (KDA): the gated delta rule with a decay per token, value head and key channel.

The math, gate, state layout and checkpoint semantics are in README.md beside this file.
"""
