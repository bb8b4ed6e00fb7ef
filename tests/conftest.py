"""Suite-wide settings: CPU by default, exact fp32 matmuls in JAX, XLA's optimizations off on CPU, GPU tests skipped
where no GPU is present."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if os.environ["JAX_PLATFORMS"] == "cpu":
    # CPU tests check values, not speed, and most of their time is XLA:CPU compiling (the kernel interpreters'
    # programs included): without XLA's and LLVM's optimization passes the suite takes about a third less time.
    # Subprocesses (the multi-device tests) inherit it.
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import sys

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


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    # Every XLA:CPU executable keeps its own memory mappings until its cache entry goes; a worker that runs most of
    # the suite passes Linux's vm.max_map_count (65,530), and the next compile's mmap fails inside LLVM as a segfault.
    # One module stays far below it (test_sequence_parallel.py, the largest, reaches about 20,000).
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
