"""Checkpointed prefill ops: one public entry per op with `implementation=`, and its paged-pool form.

Each op folder holds the float64 `reference`, the portable `xla` path and GPU kernels (`pallas_*`) behind `api.py`.
The entries load on first use, so the numpy-only parts (references, static checks) import without jax.
"""

import importlib

_ENTRIES = {
    "causal_conv1d": "conv1d", "causal_conv1d_paged": "conv1d", "gated_delta_rule": "gdn",
    "gated_delta_rule_paged": "gdn", "kda": "kda", "kda_paged": "kda", "ssd": "ssd", "ssd_paged": "ssd",
}
__all__ = sorted(_ENTRIES)


def __getattr__(name):
    if name in _ENTRIES:
        return getattr(importlib.import_module(f"{__name__}.{_ENTRIES[name]}.api"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
