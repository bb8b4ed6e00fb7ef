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


def _numpy_interpreter_callbacks():
    """Mosaic GPU's CPU interpreter (jax 0.11.2) runs every SMEM/GMEM access, barrier and wgmma as an io_callback,
    and io_callback hands the callback jax Arrays (a device_put per argument), which the interpreter then reads op by
    op through eager dispatch: most of an interpreted test's time. Handing it numpy arrays of the same values (and
    letting its index conversion take numpy scalars) runs the same interpretation, race detector included, 2.4x
    faster (one fused-pass test: 59 -> 25 s). Test-only; left alone if jax's private names move."""
    import numpy as np

    try:
        from jax._src import callback, config, tree_util
        from jax._src import xla_bridge as xb
        from jax._src.pallas.mosaic_gpu.interpret import shared_memory
    except ImportError:
        return
    if not (hasattr(callback, "io_callback_impl") and hasattr(shared_memory, "_to_int")):
        return

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        del result_avals, sharding, ordered
        cpu_device, *_ = xb.local_devices(backend="cpu")
        with config.default_device(cpu_device):
            return tree_util.tree_map(np.asarray, callback(*tree_util.tree_map(np.asarray, args)))

    to_int = shared_memory._to_int

    def _to_int(x):
        return int(x) if isinstance(x, (np.ndarray, np.generic)) else to_int(x)

    callback.io_callback_impl = io_callback_impl
    shared_memory._to_int = _to_int


if os.environ["JAX_PLATFORMS"] == "cpu":
    _numpy_interpreter_callbacks()


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
