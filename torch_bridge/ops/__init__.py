"""Triton kernels for vLLM's side of checkpointed prefill; `export_checkpoints` loads triton on first use."""

import importlib

_EXPORTS = {"export_checkpoints": "torch_bridge.ops.exporter"}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
