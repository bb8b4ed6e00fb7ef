"""torch_bridge: the torch/Triton side of jaxckpt for vLLM (spec derivation, checkpoint export).

Works with torch installed and jax absent. The checkpoint rules live only in `jaxckpt.plan`; this package imports them.
Submodules load lazily on first use, so `import torch_bridge` imports neither torch nor triton.
"""

import importlib

_SUBMODULES = ("spec", "ops")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
