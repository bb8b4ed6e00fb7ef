"""Suite-wide settings: CPU by default, exact fp32 matmuls in JAX, GPU tests skipped where no GPU is present."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest


def _has_gpu() -> bool:
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" and os.environ.get("JAXCKPT_GPU_TESTS") != "1":
        return False
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU (run with JAXCKPT_GPU_TESTS=1 on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
