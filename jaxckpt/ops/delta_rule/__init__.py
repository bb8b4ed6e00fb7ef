"""The gated delta rule: Gated DeltaNet (GDN, a scalar decay per token and value head) and Kimi Delta Attention (KDA, a
decay per key channel), one family sharing its math and kernels.

The math, the KDA gate, state layouts and checkpoint semantics are in README.md beside this file; the public entries
in `api.py`, one module per implementation beside it.
"""
