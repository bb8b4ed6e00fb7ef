"""Tables over a chunk layout (`jaxckpt.plan.layout.chunk_layout(..., xp=jnp)`), in jnp so that the metadata may be
traced: what the state passes of the Pallas kernels read to find the chunks holding checkpoints, and the lanes
(rows cut into pieces) of the Mosaic GPU state passes."""

from __future__ import annotations

import jax.numpy as jnp

from jaxckpt.plan.layout import searchsorted


def checkpoint_ranges(lay, num_chunks):
    """Per chunk, the CSR range [start, start + count) of checkpoints it holds (valid entries are chunk-sorted)."""
    ck_chunk = jnp.where(lay.checkpoint_valid, lay.checkpoint_chunk, num_chunks)
    ids = jnp.arange(num_chunks, dtype=jnp.int32)
    lo = searchsorted(jnp, ck_chunk, ids, side="left").astype(jnp.int32)
    hi = searchsorted(jnp, ck_chunk, ids, side="right").astype(jnp.int32)
    return lo, hi - lo


def checkpoint_segments(lay, checkpoint_cu):
    """Each row's range [lo, hi) of the distinct chunks holding checkpoints (i32[N] each), and those chunks ascending
    (i32[M + 1], zeros past the last)."""
    chunk = lay.checkpoint_chunk
    num_ckpt = chunk.shape[0]
    prev = jnp.concatenate([jnp.full(1, -1, jnp.int32), chunk[:-1]])
    is_first = lay.checkpoint_valid & (chunk != prev)  # valid entries are chunk-sorted
    seg_cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(is_first).astype(jnp.int32)])  # i32[M + 1]
    slot = jnp.where(is_first, seg_cu[:-1], num_ckpt)
    seg_chunk = jnp.zeros(num_ckpt + 1, jnp.int32).at[slot].set(chunk, mode="drop")
    return seg_cu[checkpoint_cu[:-1]], seg_cu[checkpoint_cu[1:]], seg_chunk


def checkpoint_chunk_ranks(lay):
    """i32[M]: each checkpoint's chunk's rank among the distinct checkpoint chunks (as `checkpoint_segments` orders
    them); padded entries get the last valid rank (their results are never used)."""
    chunk = lay.checkpoint_chunk
    prev = jnp.concatenate([jnp.full(1, -1, jnp.int32), chunk[:-1]])
    is_first = lay.checkpoint_valid & (chunk != prev)
    return jnp.maximum(jnp.cumsum(is_first).astype(jnp.int32) - 1, 0)


def split_lanes(row_first_chunk, row_num_chunks, *, pieces):
    """Each row's chunks cut into `pieces` contiguous ranges of balanced size (counts differ by at most one; a row
    of fewer chunks than pieces leaves some empty), piece p of row n at lane n * pieces + p.

    row_first_chunk, row_num_chunks     # i32[N] (`ChunkLayout`), may be traced
    Returns (lane_first, lane_count) i32[N * pieces].
    """
    first = jnp.asarray(row_first_chunk, jnp.int32)[:, None]  # [N, 1]
    count = jnp.asarray(row_num_chunks, jnp.int32)[:, None]
    bounds = first + count * jnp.arange(pieces + 1, dtype=jnp.int32) // pieces  # [N, P + 1]
    return bounds[:, :-1].reshape(-1), jnp.diff(bounds, axis=1).reshape(-1)
