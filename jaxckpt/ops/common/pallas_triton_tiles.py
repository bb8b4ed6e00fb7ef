"""Pieces shared by the Pallas Triton kernels of the delta rule and SSD (`pallas_triton_delta`, `ssd.pallas_triton`)."""

from __future__ import annotations

import jax
# Pallas defines one config flag lazily, the first time it lowers a kernel (the fuser's, imported by einshape); the
# new flag changes jit's tracing context, so a process's first jitted call would compile twice. Importing it here
# defines it before anything is traced.
import jax.experimental.pallas.fuser  # noqa: F401
import jax.numpy as jnp

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


class Dots:
    """Dot flavours: `exact` for the accuracy-critical products (the ones that build states: fp32 operands, IEEE
    for fp32 inputs), `bulk` for the large output products (16-bit operands on the tensor cores for 16-bit inputs).
    Accumulation is fp32 either way."""

    def __init__(self, io_dtype):
        self.fp32 = io_dtype == _F32
        self.io_dtype = io_dtype

    def _dot(self, a, b, dims, dtype, precision):
        return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (dims, ((), ())), precision=precision,
                                   preferred_element_type=_F32)

    def exact(self, a, b, dims=((1,), (0,))):
        return self._dot(a, b, dims, _F32, _HIGHEST if self.fp32 else None)

    def bulk(self, a, b, dims=((1,), (0,))):
        if self.fp32:
            return self._dot(a, b, dims, _F32, _HIGHEST)
        return self._dot(a, b, dims, self.io_dtype, None)


def row_mask(rows, length, shape):
    """bool[shape]: token rows below `length` (rows i32[shape[0]] broadcast over the trailing dims)."""
    return jnp.broadcast_to(rows.reshape(rows.shape + (1,) * (len(shape) - 1)) < length, shape)
