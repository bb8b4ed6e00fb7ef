"""Grouped matmul through `jax.lax.ragged_dot`: the portable path and the reference of the kernels on CPU.

XLA's GPU lowering of ragged_dot is dense (memory M * G * N), so on GPUs it suits only a few groups.
"""

from __future__ import annotations

import functools

import jax


@functools.partial(jax.jit, static_argnames=("preferred_element_type", "precision"))
def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None, precision=None):
    """lhs [M, K] (rows sorted by group), rhs [G, K, N], group_sizes i32[G] -> [M, N] (rows past the groups 0)."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                              preferred_element_type=preferred_element_type)
