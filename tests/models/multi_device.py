"""Shared by the sharded-model tests: run a check script in a fresh Python on fake CPU devices.

The device count is fixed when jax starts, so each test's checks run in one subprocess that asks for its host devices
the way `jaxckpt demo --devices N` does (`jaxckpt.cli.request_host_devices`, before jax is imported) and prints one
summary line per check, which the test asserts.

Compiles are nearly all of the time these scripts take, and both sides of every comparison (single device and
sharded) compile in the same process under the same flags, so the subprocess runs XLA:CPU's backend at -O0 and keeps a
compilation cache in a fresh temporary folder for that one run: a program built twice (the engine's sharded step and
the test's own, say) compiles once.
"""

import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(script: str) -> list[str]:
    """Runs `script` (a whole Python program) with `python -c` in the repository root; returns its stdout lines, and
    fails with its stdout and stderr when it exits non-zero."""
    with tempfile.TemporaryDirectory(prefix="jaxckpt_compile_cache_") as cache:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env |= {"JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "highest",
                "XLA_FLAGS": "--xla_backend_optimization_level=0", "JAX_COMPILATION_CACHE_DIR": cache,
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()
