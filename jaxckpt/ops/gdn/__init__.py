"""Gated DeltaNet (GDN): the gated delta rule with a scalar decay per token and value head.

The math, state layout and checkpoint semantics are in README.md beside this file.
"""
