"""Conventions shared by every part of jaxckpt and torch_bridge, and the one validator for concrete batch metadata.

Layout: tokens of all rows are packed along one axis (`[T, H, K]`); `cu_seqlens` i32[N + 1] marks the rows, row n
being tokens `[cu_seqlens[n], cu_seqlens[n + 1])` of this step (its *query*). Chunk grids restart at every row's
query start, and checkpoint offsets are relative to it: the checkpoint at offset p of row n is the state after the
row's first p query tokens, continuing from the row's initial state.

Checkpoints are given in CSR form: `checkpoint_cu` i32[N + 1] and `checkpoint_offsets` i32[M], the entries
`[checkpoint_cu[n], checkpoint_cu[n + 1])` belonging to row n, strictly ascending inside `(0, query_len)`.
Entries past `checkpoint_cu[N]` are padding (bucketed shapes): they carry `PAD_CHECKPOINT_OFFSET` and the null slot,
and every implementation ignores them.

State pools: slot `NULL_SLOT` (0) of every pool is never read as a real state and never written. vLLM's -1 padding
slots are mapped to it at the torch_bridge boundary (a -1 index in JAX would silently wrap to the last slot).
"""

from __future__ import annotations

import numpy as np

NULL_SLOT = 0
PAD_CHECKPOINT_OFFSET = 0
STATE_LAYOUTS = ("kv", "vk")


def _as_int_vector(value, *, name: str) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != 1:
        raise ValueError(f"{name}: must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        if not np.all(np.equal(np.mod(array, 1), 0)):
            raise ValueError(f"{name}: must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64)


def check_state_layout(state_layout: str) -> str:
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout: must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    return state_layout


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_non_negative(value: int, *, name: str) -> int:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")
    return int(value)


def check_positive(value: int, *, name: str) -> int:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    return int(value)


def validate_cu_seqlens(cu_seqlens, num_tokens: int, *, name: str = "cu_seqlens") -> np.ndarray:
    """Returns `cu_seqlens` as i32[N + 1] after checking it starts at 0, never decreases and ends within the tokens.

    `cu_seqlens=None` means one row over all `num_tokens`. Tokens past `cu_seqlens[-1]` are padding.
    """
    if cu_seqlens is None:
        return np.array([0, num_tokens], dtype=np.int32)
    cu = _as_int_vector(cu_seqlens, name=name)
    if cu.size < 2:
        raise ValueError(f"{name}: needs at least 2 entries (N + 1 for N >= 1 rows), got {cu.size}")
    if cu[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {name}[0]={cu[0]}")
    steps = np.diff(cu)
    if np.any(steps < 0):
        i = int(np.argmax(steps < 0))
        raise ValueError(f"{name}: must be non-decreasing, got {name}[{i}]={cu[i]} > {name}[{i + 1}]={cu[i + 1]}")
    if cu[-1] > num_tokens:
        raise ValueError(f"{name}: last entry {cu[-1]} exceeds the number of tokens {num_tokens}")
    if cu[-1] >= 2**31:
        raise ValueError(f"{name}: entries must fit in int32, got {cu[-1]}")
    return cu.astype(np.int32)


def validate_checkpoints(checkpoint_cu, checkpoint_offsets, cu_seqlens) -> tuple[np.ndarray, np.ndarray]:
    """Checks a CSR checkpoint list against concrete rows; returns (i32[N + 1], i32[M]).

    Both None means no checkpoints. Row n's offsets must be strictly ascending inside (0, query_len); entries past
    `checkpoint_cu[N]` must be padding (`PAD_CHECKPOINT_OFFSET`).
    """
    cu_seqlens = np.asarray(cu_seqlens)
    num_rows = cu_seqlens.size - 1
    if checkpoint_cu is None and checkpoint_offsets is None:
        return np.zeros(num_rows + 1, np.int32), np.zeros(0, np.int32)
    if checkpoint_cu is None or checkpoint_offsets is None:
        raise ValueError("checkpoint_cu and checkpoint_offsets: give both or neither")
    ccu = _as_int_vector(checkpoint_cu, name="checkpoint_cu")
    offsets = _as_int_vector(checkpoint_offsets, name="checkpoint_offsets")
    if ccu.size != num_rows + 1:
        raise ValueError(f"checkpoint_cu: needs N + 1 = {num_rows + 1} entries (one more than rows), got {ccu.size}")
    if ccu[0] != 0:
        raise ValueError(f"checkpoint_cu: must start at 0, got {ccu[0]}")
    if np.any(np.diff(ccu) < 0):
        raise ValueError("checkpoint_cu: must be non-decreasing")
    if ccu[-1] > offsets.size:
        raise ValueError(f"checkpoint_cu: last entry {ccu[-1]} exceeds len(checkpoint_offsets)={offsets.size}")
    for n in range(num_rows):
        row = offsets[ccu[n]:ccu[n + 1]]
        if row.size == 0:
            continue
        query_len = int(cu_seqlens[n + 1] - cu_seqlens[n])
        if row[0] <= 0 or row[-1] >= query_len:
            raise ValueError(
                f"checkpoint_offsets: row {n} has offsets {row.tolist()} outside (0, query_len={query_len})")
        if np.any(np.diff(row) <= 0):
            raise ValueError(f"checkpoint_offsets: row {n} offsets {row.tolist()} must be strictly ascending")
    padding = offsets[ccu[-1]:]
    if np.any(padding != PAD_CHECKPOINT_OFFSET):
        raise ValueError(f"checkpoint_offsets: padded entries (past checkpoint_cu[N]={ccu[-1]}) must be "
                         f"PAD_CHECKPOINT_OFFSET={PAD_CHECKPOINT_OFFSET}")
    return ccu.astype(np.int32), offsets.astype(np.int32)


def checkpoint_rows(checkpoint_cu, num_checkpoints: int) -> np.ndarray:
    """Row of each CSR entry, i32[M]; -1 for padded entries."""
    ccu = np.asarray(checkpoint_cu, np.int64)
    rows = np.full(num_checkpoints, -1, np.int32)
    counts = np.diff(ccu)
    rows[:ccu[-1]] = np.repeat(np.arange(counts.size, dtype=np.int32), counts)
    return rows


def pad_checkpoints(checkpoint_cu, checkpoint_offsets, size: int, *, checkpoint_state_indices=None):
    """Pads a CSR list to `size` entries with the sentinel offset (and the null slot for `checkpoint_state_indices`)."""
    offsets = np.asarray(checkpoint_offsets, np.int32)
    if size < int(np.asarray(checkpoint_cu)[-1]):
        raise ValueError(f"size: {size} is smaller than the number of real checkpoints {int(checkpoint_cu[-1])}")
    padded = np.full(size, PAD_CHECKPOINT_OFFSET, np.int32)
    real = int(np.asarray(checkpoint_cu)[-1])
    padded[:real] = offsets[:real]
    if checkpoint_state_indices is None:
        return padded
    slots = np.full(size, NULL_SLOT, np.int32)
    slots[:real] = np.asarray(checkpoint_state_indices, np.int32)[:real]
    return padded, slots


def checkpoints_from_rows(offsets, columns=None):
    """Converts vLLM's per-row form (offset 0 / column -1 = none; [N] or [N, K]) to CSR.

    Returns (checkpoint_cu i32[N + 1], checkpoint_offsets i32[M], checkpoint_columns i32[M] or None).
    """
    offs = np.asarray(offsets, np.int64)
    if offs.ndim == 1:
        offs = offs[:, None]
    cols = None
    if columns is not None:
        cols = np.asarray(columns, np.int64)
        if cols.ndim == 1:
            cols = cols[:, None]
        if cols.shape != offs.shape:
            raise ValueError(f"columns: shape {cols.shape} does not match offsets {offs.shape}")
    keep = offs > 0
    if cols is not None and np.any(keep & (cols < 0)):
        raise ValueError("columns: a row with a checkpoint offset has column -1")
    counts = keep.sum(axis=1)
    ccu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    flat_offsets = offs[keep].astype(np.int32)
    flat_columns = None if cols is None else cols[keep].astype(np.int32)
    return ccu, flat_offsets, flat_columns


def checkpoints_to_rows(checkpoint_cu, checkpoint_offsets, checkpoint_columns=None, *, max_per_row: int = 1):
    """Converts CSR to vLLM's per-row form: offsets [N] (or [N, max_per_row]) with 0 = none, columns with -1."""
    ccu = np.asarray(checkpoint_cu, np.int64)
    num_rows = ccu.size - 1
    counts = np.diff(ccu)
    if counts.size and counts.max() > max_per_row:
        raise ValueError(f"max_per_row: row has {int(counts.max())} checkpoints, more than {max_per_row}")
    offs = np.zeros((num_rows, max_per_row), np.int32)
    cols = np.full((num_rows, max_per_row), -1, np.int32)
    for n in range(num_rows):
        c = int(counts[n])
        offs[n, :c] = np.asarray(checkpoint_offsets)[ccu[n]:ccu[n + 1]]
        if checkpoint_columns is not None:
            cols[n, :c] = np.asarray(checkpoint_columns)[ccu[n]:ccu[n + 1]]
    if max_per_row == 1:
        offs, cols = offs[:, 0], cols[:, 0]
    return (offs, cols) if checkpoint_columns is not None else offs


def validate_slots(indices, num_slots: int, *, name: str, allow_null: bool = True) -> np.ndarray:
    """Checks pool slot indices are in [0, num_slots) (or [1, num_slots) when the null slot is not allowed)."""
    idx = _as_int_vector(indices, name=name)
    low = NULL_SLOT if allow_null else NULL_SLOT + 1
    if idx.size and (idx.min() < low or idx.max() >= num_slots):
        bad = idx[(idx < low) | (idx >= num_slots)][0]
        raise ValueError(f"{name}: slot {bad} is outside [{low}, {num_slots}) of the state pool")
    return idx.astype(np.int32)


def map_vllm_slots(indices) -> np.ndarray:
    """vLLM pads slot tables with -1; maps those to the null slot (a -1 in JAX would wrap to the last slot)."""
    idx = np.asarray(indices, np.int64)
    if np.any(idx < -1):
        raise ValueError(f"indices: vLLM slots must be >= -1, got {int(idx.min())}")
    return np.where(idx < 0, NULL_SLOT, idx).astype(np.int32)
