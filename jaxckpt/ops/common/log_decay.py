"""Sums of log decays over token ranges, computed without cancellation, for the chunked XLA recurrences.

A chunked recurrence needs exp(G_i - G_j) for the cumulative log decay G = cumsum(g) of a chunk. Taking that
difference of two cumulative sums cancels: after one strong decay (g = -1e4) every later G is about -1e4 and their
fp32 differences lose four digits; after a zero decay (g = -inf, a state reset) they are -inf - -inf = NaN. Summing g
over the range itself keeps every sum as accurate as its own terms, and a range that holds -inf sums to exactly -inf
(decay exactly 0), so a reset is exact. The chunk axis is -2 throughout, with a channel axis after it (size 1 for one
decay per head).

The Pallas kernels take differences of chunk cumsums instead, read from tiles. For them `floor_log_decay` raises
every token's log decay to LOG_DECAY_FLOOR first: exp(-110) is 0 in fp32, so any decay factor over a range that holds
such a token is exactly 0 before and after the floor (the other terms are <= 0), and the cumsums stay finite (no
-inf - -inf). A plain fp32 cumsum would still cancel: after a floored token, or a few moderate ones (-30), every
later G is about that large, and G_i - G_j for two later tokens keeps only its absolute error, eps |G| (1e-5 of
rel-RMS against float64 was seen). `split_cumsum` removes that cancellation: each log decay is cut into a coarse
part on a 2^-10 grid and the fine rest, G = hi + lo, and hi is the cumsum of the coarse parts, exact in any
summation order (every partial sum is a grid multiple below 64 * 110 < 2^13, which 10 fraction bits keep inside
fp32's 24-bit significand). So G_i - G_j = (hi_i - hi_j) + (lo_i - lo_j) with the first difference exact and the
second of size <= C / 2^10, whose rounding (at most about 1e-7 in all, however large G has grown) is all the error
the exponent carries, where a plain cumsum difference loses eps |G| (7e-6 after one floored token).
"""

from __future__ import annotations

import jax.numpy as jnp

LOG_DECAY_FLOOR = -110.0
SPLIT_GRID_BITS = 10
MAX_SPLIT_CHUNK = 64
# the exactness of `split_cumsum`'s hi part: |partial sums| <= C (110 + 2^-10) stay below 2^(24 - SPLIT_GRID_BITS)
assert MAX_SPLIT_CHUNK * (1 - LOG_DECAY_FLOOR) < 2 ** (24 - SPLIT_GRID_BITS)


def pair_log_decays(g):
    """sum_{j < t <= i} g_t for j <= i and -inf above the diagonal: g [..., C, Kg] -> [..., C(i), C(j), Kg]."""
    size = g.shape[-2]
    pos = jnp.arange(size)
    after_j = (pos[None, :] > pos[:, None])[:, :, None]  # [C(j), C(t), 1]
    sums = jnp.cumsum(jnp.where(after_j, g[..., None, :, :], 0), axis=-2)  # [..., C(j), C(i), Kg]
    sums = jnp.swapaxes(sums, -2, -3)  # [..., C(i), C(j), Kg]
    lower = (pos[:, None] >= pos[None, :])[:, :, None]
    return jnp.where(lower, sums, -jnp.inf)


def suffix_log_decays(g):
    """sum_{t > i} g_t, the log decay from after token i to the chunk's end: g [..., C, Kg] -> [..., C, Kg]."""
    inclusive = jnp.flip(jnp.cumsum(jnp.flip(g, axis=-2), axis=-2), axis=-2)
    return jnp.concatenate([inclusive[..., 1:, :], jnp.zeros_like(inclusive[..., :1, :])], axis=-2)


def floor_log_decay(log_decay):
    """Per-token log decays raised to LOG_DECAY_FLOOR (NaN stays NaN): the same decay factors, finite cumsums. A
    select, not `jnp.maximum`: the Pallas Triton lowering of max is NaN-dropping (`maxnumf`), and inside a kernel a
    NaN gate must still poison its row."""
    return jnp.where(log_decay < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, log_decay)


def split_cumsum(log_decay, axis):
    """Inclusive cumsums of floored log decays (`floor_log_decay`, at most MAX_SPLIT_CHUNK along `axis`) as (hi, lo),
    hi + lo = G: hi exact on multiples of 2^-SPLIT_GRID_BITS, lo in [0, size / 2^SPLIT_GRID_BITS) (module docstring).
    Runs in XLA and inside Pallas kernels alike."""
    grid = float(2 ** SPLIT_GRID_BITS)
    coarse = jnp.floor(log_decay * grid) * (1.0 / grid)  # both products by powers of two: exact
    return jnp.cumsum(coarse, axis=axis), jnp.cumsum(log_decay - coarse, axis=axis)
