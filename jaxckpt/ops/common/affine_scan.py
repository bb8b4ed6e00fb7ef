"""The inter-chunk state pass of the chunked recurrences as a parallel prefix scan over chunk affine maps.

Within a chunk every recurrence here updates its state affinely, S_out = M_c S_in + E_c (kernels.md §2.5): the delta
rule's M_c = diag(exp(G_last)) - Ktil^T W is K x K, SSD's M_c = exp(Acs_last) a scalar per head. Composing two maps is
again affine, (M2, E2) o (M1, E1) = (M2 M1, M2 E1 + E2), and associative, so `jax.lax.associative_scan` gives the
state after every chunk in O(log NC) dependent steps instead of the NC steps of a `lax.scan`, at the price of the
map products (about NC of them in the up-sweep; the down-sweep's map products are unused and XLA removes them).

A row start cuts the chain: its chunk ignores the state before it, so the composition selects (`where`, never a
product) the later map whenever the later element starts a row, and nothing computed for an earlier row reaches it.
Multiplying by a zero map would not do: 0 x NaN = NaN, so one row's non-finite state would poison every later row.
With the flag the operator is the segmented scan's, still associative. Chunks past the used ones are identity maps
(zero inputs), and nothing reads their states.

`matmul_policy` is the matmul precision rule the chunked XLA ops share (fp32 class vs bf16 class by input dtype).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def affine_scan(maps, offsets, resets, *, apply: Callable):
    """States after each element of S_i = M_i S_{i-1} + E_i along axis 0, from S_{-1} = 0, cut where a row starts.

    maps                # [NC, ...] the linear parts M_i (ignored where `resets` is set)
    offsets             # [NC, ...] the offsets E_i (a resetting element's offset already holds its initial state)
    resets              # bool[NC] True where an element starts a row: S_i = E_i, whatever S_{i-1} holds
    `apply(m, x)` is m x for a map m and either a state / offset x or another map (composition); it fixes the
    matmul precision. Returns the states [NC, ...] like offsets.
    """
    def combine(earlier, later):
        (m1, e1, r1), (m2, e2, r2) = earlier, later
        cut_m = r2.reshape(r2.shape + (1,) * (m2.ndim - r2.ndim))
        cut_e = r2.reshape(r2.shape + (1,) * (e2.ndim - r2.ndim))
        return (jnp.where(cut_m, m2, apply(m2, m1)), jnp.where(cut_e, e2, apply(m2, e1) + e2), r1 | r2)

    _, states, _ = jax.lax.associative_scan(combine, (maps, offsets, resets))
    return states


def matmul_policy(*dtypes) -> tuple[Callable, Callable]:
    """(dot, state_dot): contractions `f(spec, a, b)` with fp32 results, for inputs of these dtypes.

    fp32 class (any input wider than 16 bits): both at Precision.HIGHEST (DEFAULT would be TF32 on GPUs).
    bf16 class (all 16-bit): `dot` rounds its operands to bf16 and accumulates in fp32 (tensor cores); `state_dot`,
    for the products that add new keys and values into the carried state, splits each operand into bf16 high and low
    parts and keeps three of the four products (bf16x3: near-fp32 accuracy from three bf16 matmuls).
    """
    if any(jnp.dtype(dtype).itemsize > 2 for dtype in dtypes):
        def dot(spec, a, b):
            return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)
        return dot, dot

    def dot(spec, a, b):
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)

    def state_dot(spec, a, b):
        a_high, b_high = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        a_low, b_low = a - a_high.astype(a.dtype), b - b_high.astype(b.dtype)
        return dot(spec, a_high, b_high) + (dot(spec, a_high, b_low) + dot(spec, a_low, b_high))
    return dot, state_dot
