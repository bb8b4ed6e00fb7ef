"""Planners: how a chunked kernel or a split-at-checkpoint driver lays out one step's rows and checkpoints.

`chunk_layout` is written against an array namespace (`xp=numpy` on the host, `xp=jax.numpy` inside a traced
function), so the same arithmetic serves the host planner and jit-compiled kernels with traced metadata; every
output has a static size fixed by (num_tokens, num_rows, num_checkpoints, chunk_size).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxckpt.plan.checks import check_metadata_shapes
from jaxckpt.plan.conventions import (check_flag, check_non_negative, check_positive, check_rows, validate_checkpoints,
                                      validate_cu_seqlens)


class ChunkLayout(NamedTuple):
    """Chunks of at most `chunk_size` tokens, counted from each row's query start (or each forced break).

    A checkpoint's state is the state after the first `checkpoint_pos` tokens of chunk `checkpoint_chunk`
    (`checkpoint_pos == 0`: the state entering that chunk). Unused chunk entries have `chunk_len == 0`.
    """

    chunk_row: object         # i32[NC] row of each chunk (clipped into range for unused chunks)
    chunk_start: object       # i32[NC] packed index of the chunk's first token
    chunk_len: object         # i32[NC] valid tokens in the chunk, 0 for unused chunks
    chunk_first: object       # bool[NC] first chunk of its row: the carried state restarts from the initial state
    row_first_chunk: object   # i32[N]
    row_num_chunks: object    # i32[N] 0 for an empty row (its final state is its initial state)
    token_chunk: object       # i32[T] chunk of each token (0 for padding tokens)
    token_pos: object         # i32[T] position of each token inside its chunk
    token_valid: object       # bool[T] False for padding tokens past cu_seqlens[N]
    checkpoint_row: object    # i32[M] (0 for padded entries)
    checkpoint_chunk: object  # i32[M]
    checkpoint_pos: object    # i32[M] in [0, chunk_size)
    checkpoint_valid: object  # bool[M] False for padded entries


def searchsorted(xp, sorted_values, queries, *, side: str = "left"):
    """`xp.searchsorted`; for jax.numpy the unrolled binary search: its default method is a `while` loop, which
    XLA runs on GPU as host-driven iterations, each paying a launch's latency (measured on the H200,
    bench/README.md, "Variants measured and not taken")."""
    if xp is np:
        return np.searchsorted(sorted_values, queries, side=side)
    return xp.searchsorted(sorted_values, queries, side=side, method="scan_unrolled")


def max_chunks(num_tokens: int, num_rows: int, num_checkpoints: int, chunk_size: int, *, forced_breaks: bool) -> int:
    """Static upper bound on the chunk count: sum(cdiv(len_i, C)) <= T // C + pieces."""
    num_tokens = check_non_negative(num_tokens, name="num_tokens")
    num_rows = check_non_negative(num_rows, name="num_rows")
    num_checkpoints = check_non_negative(num_checkpoints, name="num_checkpoints")
    chunk_size = check_positive(chunk_size, name="chunk_size")
    forced_breaks = check_flag(forced_breaks, name="forced_breaks")
    pieces = num_rows + (num_checkpoints if forced_breaks else 0)
    return num_tokens // chunk_size + pieces


def chunk_layout(cu_seqlens, checkpoint_cu, checkpoint_offsets, *, chunk_size: int, num_tokens: int,
                 forced_breaks: bool = False, xp=np) -> ChunkLayout:
    """Chunk table for packed rows with CSR checkpoints (padded entries allowed).

    With `forced_breaks`, each checkpoint starts a new chunk grid (the carried state there is the checkpoint);
    otherwise the grid stays anchored at the query start and the kernel reads the state inside the chunk.
    On the host (`xp=numpy`) the metadata values are validated; with another namespace they may be traced, so only
    their shapes and dtypes are checked and the values are the caller's to vouch for.
    """
    chunk_size = check_positive(chunk_size, name="chunk_size")
    num_tokens = check_non_negative(num_tokens, name="num_tokens")
    forced_breaks = check_flag(forced_breaks, name="forced_breaks")
    if xp is np:
        cu_seqlens = validate_cu_seqlens(cu_seqlens, num_tokens)
        checkpoint_cu, checkpoint_offsets = validate_checkpoints(checkpoint_cu, checkpoint_offsets, cu_seqlens)
    else:
        check_metadata_shapes(*(xp.asarray(a) for a in (cu_seqlens, checkpoint_cu, checkpoint_offsets)))
    i32 = xp.int32
    cu = xp.asarray(cu_seqlens).astype(i32)                 # i32[N + 1]
    ccu = xp.asarray(checkpoint_cu).astype(i32)             # i32[N + 1]
    offsets = xp.asarray(checkpoint_offsets).astype(i32)    # i32[M]
    num_rows = cu.shape[0] - 1
    num_ckpt = offsets.shape[0]
    ckpt_ids = xp.arange(num_ckpt, dtype=i32)
    checkpoint_valid = ckpt_ids < ccu[-1]
    checkpoint_row = xp.clip(searchsorted(xp, ccu, ckpt_ids, side="right").astype(i32) - 1, 0, max(num_rows - 1, 0))
    ckpt_global = xp.where(checkpoint_valid, cu[checkpoint_row] + offsets, cu[-1])   # i32[M]

    if forced_breaks:
        bounds = xp.sort(xp.concatenate([cu, ckpt_global]))  # i32[N + M + 1] piece starts (+ end), padding at cu[N]
    else:
        bounds = cu
    piece_len = bounds[1:] - bounds[:-1]
    piece_chunks = (piece_len + chunk_size - 1) // chunk_size
    piece_chunk_cu = xp.concatenate([xp.zeros(1, i32), xp.cumsum(piece_chunks).astype(i32)])
    num_pieces = piece_len.shape[0]

    nc = max_chunks(num_tokens, num_rows, num_ckpt, chunk_size, forced_breaks=forced_breaks)
    chunk_ids = xp.arange(nc, dtype=i32)
    chunk_piece = xp.clip(searchsorted(xp, piece_chunk_cu, chunk_ids, side="right").astype(i32) - 1, 0,
                          num_pieces - 1)
    in_piece = chunk_ids - piece_chunk_cu[chunk_piece]
    chunk_start = bounds[chunk_piece] + in_piece * chunk_size
    chunk_used = chunk_ids < piece_chunk_cu[-1]
    chunk_len = xp.where(chunk_used, xp.minimum(chunk_size, bounds[chunk_piece + 1] - chunk_start), 0)
    chunk_start = xp.where(chunk_used, chunk_start, 0)
    chunk_row = xp.clip(searchsorted(xp, cu, chunk_start, side="right").astype(i32) - 1, 0, max(num_rows - 1, 0))
    chunk_first = chunk_used & (in_piece == 0) & (chunk_start == cu[chunk_row])

    # first piece of row n starts at cu[n]; with forced breaks it is the first bound equal to cu[n]
    row_first_piece = searchsorted(xp, bounds, cu[:-1], side="left").astype(i32) if forced_breaks \
        else xp.arange(num_rows, dtype=i32)
    row_end_piece = searchsorted(xp, bounds, cu[1:], side="left").astype(i32) if forced_breaks \
        else xp.arange(1, num_rows + 1, dtype=i32)
    row_first_chunk = piece_chunk_cu[row_first_piece]
    row_num_chunks = piece_chunk_cu[row_end_piece] - row_first_chunk

    token_ids = xp.arange(num_tokens, dtype=i32)
    token_valid = token_ids < cu[-1]
    token_piece = xp.clip(searchsorted(xp, bounds, token_ids, side="right").astype(i32) - 1, 0, num_pieces - 1)
    in_token_piece = token_ids - bounds[token_piece]
    token_chunk = xp.where(token_valid, piece_chunk_cu[token_piece] + in_token_piece // chunk_size, 0)
    token_pos = xp.where(token_valid, in_token_piece % chunk_size, 0)

    if forced_breaks:
        ckpt_piece = searchsorted(xp, bounds, ckpt_global, side="left").astype(i32)
        checkpoint_chunk = piece_chunk_cu[xp.clip(ckpt_piece, 0, num_pieces - 1)]
        checkpoint_pos = xp.zeros(num_ckpt, i32)
    else:
        checkpoint_chunk = row_first_chunk[checkpoint_row] + offsets // chunk_size if num_rows else ckpt_ids
        checkpoint_pos = offsets % chunk_size
    checkpoint_chunk = xp.where(checkpoint_valid, checkpoint_chunk, 0)
    checkpoint_pos = xp.where(checkpoint_valid, checkpoint_pos, 0)
    return ChunkLayout(chunk_row.astype(i32), chunk_start.astype(i32), chunk_len.astype(i32), chunk_first,
                       row_first_chunk.astype(i32), row_num_chunks.astype(i32), token_chunk.astype(i32),
                       token_pos.astype(i32), token_valid, checkpoint_row.astype(i32), checkpoint_chunk.astype(i32),
                       checkpoint_pos.astype(i32), checkpoint_valid)


class SplitLaunch(NamedTuple):
    """One launch of the split-at-checkpoint strategy: segment j of every row that has one.

    `rows` are the participating rows; `cu_seqlens` packs their segments in that order; `token_indices` maps the
    launch's packed tokens to the step's packed tokens. Launch 0 reads each row's initial state; launch j > 0 continues
    from the row's final state of launch j - 1, which is checkpoint j - 1 of that row. `checkpoint_ids[i]` is the CSR
    index of the checkpoint that row `rows[i]`'s final state of this launch is, or -1 when it is the row's real
    final state.
    """

    rows: np.ndarray            # i32[R]
    cu_seqlens: np.ndarray      # i32[R + 1]
    token_indices: np.ndarray   # i32[T_j]
    checkpoint_ids: np.ndarray  # i32[R]


def split_layout(cu_seqlens, checkpoint_cu, checkpoint_offsets) -> list[SplitLaunch]:
    """Cuts each row at its checkpoints; k checkpoints per row need k + 1 dependent launches, no tail recompute."""
    cu = check_rows(cu_seqlens)
    ccu, offsets = validate_checkpoints(checkpoint_cu, checkpoint_offsets, cu)
    num_rows = cu.size - 1
    counts = np.diff(ccu)
    num_launches = int(counts.max()) + 1 if num_rows else 1
    launches = []
    for j in range(num_launches):
        rows, seg_cu, tokens, ckpt_ids = [], [0], [], []
        for n in range(num_rows):
            k = int(counts[n])
            if j > k:
                continue
            cuts = [0, *offsets[ccu[n]:ccu[n + 1]].tolist(), int(cu[n + 1] - cu[n])]
            start, end = int(cu[n]) + cuts[j], int(cu[n]) + cuts[j + 1]
            rows.append(n)
            tokens.append(np.arange(start, end))
            seg_cu.append(seg_cu[-1] + end - start)
            ckpt_ids.append(int(ccu[n]) + j if j < k else -1)
        launches.append(SplitLaunch(np.asarray(rows, np.int32), np.asarray(seg_cu, np.int32),
                                    np.concatenate(tokens).astype(np.int32) if tokens else np.zeros(0, np.int32),
                                    np.asarray(ckpt_ids, np.int32)))
    return launches


def bucket_size(n: int, *, minimum: int = 16) -> int:
    """Pads a size to the next power of two (at least `minimum`), so a new batch seldom needs a new compile."""
    n = check_non_negative(n, name="n")
    size = max(check_non_negative(minimum, name="minimum"), 1)
    while size < n:
        size *= 2
    return size
