"""jaxckpt: checkpointed prefill for recurrent layers (Mamba2/SSD, Gated DeltaNet, Kimi Delta Attention, conv1d).

`jaxckpt.plan` is pure Python + numpy and imports without jax; everything else loads lazily on first use.
"""

import importlib

__version__ = "0.1.0"
_SUBMODULES = ("plan", "ops", "layers", "models", "engine", "cli")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
