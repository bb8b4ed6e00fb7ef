"""Sums of log decays over token ranges, computed without cancellation, for the chunked XLA recurrences.

A chunked recurrence needs exp(G_i - G_j) for the cumulative log decay G = cumsum(g) of a chunk. Taking that
difference of two cumulative sums cancels: after one strong decay (g = -1e4) every later G is about -1e4 and their
fp32 differences lose four digits; after a zero decay (g = -inf, a state reset) they are -inf - -inf = NaN. Summing g
over the range itself keeps every sum as accurate as its own terms, and a range that holds -inf sums to exactly -inf
(decay exactly 0), so a reset is exact. The chunk axis is -2 throughout, with a channel axis after it (size 1 for one
decay per head).

The Pallas kernels take differences of chunk cumsums instead. For them `floor_log_decay` raises every token's log
decay to LOG_DECAY_FLOOR first: exp(-110) is 0 in fp32, so any decay factor over a range that holds such a token is
exactly 0 before and after the floor (the other terms are <= 0), while the cumsums stay finite and small (no
-inf - -inf, and about 110 instead of 1e4 to cancel after a strong decay).
"""

from __future__ import annotations

import jax.numpy as jnp

LOG_DECAY_FLOOR = -110.0


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
    """Per-token log decays raised to LOG_DECAY_FLOOR (NaN stays NaN): the same decay factors, finite cumsums."""
    return jnp.maximum(log_decay, LOG_DECAY_FLOOR)
