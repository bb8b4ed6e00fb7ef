"""Pieces shared by the Pallas Triton kernels of the delta rule and SSD (`delta_rule.pallas_triton`,
`delta_rule.cumsum`, `ssd.pallas_triton`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

# Pallas defines one config flag lazily, the first time it lowers a kernel (the fuser's, imported by einshape); the
# new flag changes jit's tracing context, so a process's first jitted call would compile twice. Importing it here
# defines it before anything is traced.
import jax.experimental.pallas.fuser  # noqa: F401
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
_LOG2E = 1.4426950408889634


def exp2e(x):
    """exp(x) as exp2(x log2 e): one MUFU.EX2 and a multiply on the GPU, where jnp.exp is libdevice's longer expf."""
    return jnp.exp2(x * _LOG2E)


class Cumsum(NamedTuple):
    """A tile of a chunk-local cumulative log decay G: whole (lo None), or `log_decay.split_cumsum`'s hi + lo, whose
    differences cancel nothing however large G has grown."""

    hi: object
    lo: object = None

    def map(self, fn):
        return Cumsum(fn(self.hi), None if self.lo is None else fn(self.lo))

    def gap(self, other):
        """G_self - G_other: the log decay over the tokens after `other`'s row up to `self`'s."""
        diff = self.hi - other.hi
        return diff if self.lo is None else diff + (self.lo - other.lo)

    def exp(self):
        """exp(G): the decay from the chunk start."""
        return exp2e(self.hi if self.lo is None else self.hi + self.lo)


@dataclasses.dataclass(frozen=True)
class CumsumRefs:
    """A kernel's refs of G (hi, and lo when split); indexing reads a `Cumsum` tile."""

    hi: object
    lo: object = None

    def __getitem__(self, index):
        return Cumsum(self.hi[index], None if self.lo is None else self.lo[index])

    @classmethod
    def pop(cls, refs: list, split: bool) -> "CumsumRefs":
        """G's refs off the front of a kernel's ref list (two when split)."""
        return cls(refs.pop(0), refs.pop(0) if split else None)


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


def load_tokens(ref_at, rows, length, shape):
    """Masked load of token rows [start, start + rows.size) of a packed array; rows past `length` read 0."""
    return plt.load(ref_at, mask=row_mask(rows, length, shape), other=0).astype(_F32)
