"""Conventions shared by every part of jaxckpt and torch_bridge, and the one validator of the host-side contract.

Validators: integer sizes are Python ints or numpy integer scalars (never bools), returned as Python ints so that
arithmetic on a numpy uint8 cannot wrap; flags are bools; index arrays are concrete integer arrays (never bool masks);
the batch metadata below. Every failure is a ValueError whose message starts with the argument's name.

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


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value, *, name: str, minimum: int | None = None) -> int:
    """A Python int or numpy integer scalar, returned as a Python int (numpy scalars would overflow in arithmetic)."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}: must be an integer, got the bool {value!r}")
    if not _is_int(value):
        raise ValueError(f"{name}: must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        rule = {0: "non-negative", 1: "positive"}.get(minimum, f">= {minimum}")
        raise ValueError(f"{name}: must be {rule}, got {value}")
    return value


def check_non_negative(value: int, *, name: str) -> int:
    return check_int(value, name=name, minimum=0)


def check_positive(value: int, *, name: str) -> int:
    return check_int(value, name=name, minimum=1)


def check_optional_positive(value: int | None, *, name: str) -> int | None:
    return None if value is None else check_positive(value, name=name)


def check_flag(value, *, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}: must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_choice(value, choices: tuple, *, name: str):
    if not any(value is c or (isinstance(value, str) and value == c) for c in choices):
        raise ValueError(f"{name}: must be one of {choices}, got {value!r}")
    return value


def check_state_layout(state_layout: str) -> str:
    return check_choice(state_layout, STATE_LAYOUTS, name="state_layout")


def check_int_array(value, *, name: str, ndim: int | tuple[int, ...] = 1) -> np.ndarray:
    """A concrete integer array (empty ones of any dtype pass: `[]` is a float array), returned as int64."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}: must be an integer array, got {type(value).__name__} ({error})") from None
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if array.ndim not in ndims:
        rule = " or ".join(f"{n}-D" for n in ndims)
        raise ValueError(f"{name}: must be {rule}, got shape {array.shape}")
    if array.dtype == np.bool_:
        raise ValueError(f"{name}: must hold integers, got a bool array (a mask is not an index array)")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name}: must hold integers, got dtype {array.dtype}")
    if array.size and array.dtype == np.uint64 and array.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: entries must fit in int64, got {array.max()}")
    return array.astype(np.int64)


def _check_csr(checkpoint_cu, *, num_rows: int | None, num_entries: int | None) -> np.ndarray:
    ccu = check_int_array(checkpoint_cu, name="checkpoint_cu")
    if num_rows is not None and ccu.size != num_rows + 1:
        raise ValueError(f"checkpoint_cu: needs N + 1 = {num_rows + 1} entries (one more than rows), got {ccu.size}")
    if ccu.size < 1:
        raise ValueError("checkpoint_cu: needs N + 1 entries, got none")
    if ccu[0] != 0:
        raise ValueError(f"checkpoint_cu: must start at 0, got {ccu[0]}")
    if np.any(np.diff(ccu) < 0):
        i = int(np.argmax(np.diff(ccu) < 0))
        raise ValueError(f"checkpoint_cu: must be non-decreasing, got checkpoint_cu[{i}]={ccu[i]} > "
                         f"checkpoint_cu[{i + 1}]={ccu[i + 1]}")
    if num_entries is not None and ccu[-1] > num_entries:
        raise ValueError(f"checkpoint_cu: last entry {ccu[-1]} exceeds len(checkpoint_offsets)={num_entries}")
    return ccu


def check_rows(cu_seqlens, *, name: str = "cu_seqlens") -> np.ndarray:
    """`cu_seqlens` as int64[N + 1]: N >= 1 rows, starts at 0, never decreases, fits in int32."""
    cu = check_int_array(cu_seqlens, name=name)
    if cu.size < 2:
        raise ValueError(f"{name}: needs at least 2 entries (N + 1 for N >= 1 rows), got {cu.size}")
    if cu[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {name}[0]={cu[0]}")
    steps = np.diff(cu)
    if np.any(steps < 0):
        i = int(np.argmax(steps < 0))
        raise ValueError(f"{name}: must be non-decreasing, got {name}[{i}]={cu[i]} > {name}[{i + 1}]={cu[i + 1]}")
    if cu[-1] >= 2**31:
        raise ValueError(f"{name}: entries must fit in int32, got {cu[-1]}")
    return cu


def validate_cu_seqlens(cu_seqlens, num_tokens: int, *, name: str = "cu_seqlens") -> np.ndarray:
    """Returns `cu_seqlens` as i32[N + 1] after checking it starts at 0, never decreases and ends within the tokens.

    `cu_seqlens=None` means one row over all `num_tokens`. Tokens past `cu_seqlens[-1]` are padding.
    """
    num_tokens = check_non_negative(num_tokens, name="num_tokens")
    if cu_seqlens is None:
        return np.array([0, num_tokens], dtype=np.int32)
    cu = check_rows(cu_seqlens, name=name)
    if cu[-1] > num_tokens:
        raise ValueError(f"{name}: last entry {cu[-1]} exceeds the number of tokens {num_tokens}")
    return cu.astype(np.int32)


def validate_checkpoints(checkpoint_cu, checkpoint_offsets, cu_seqlens) -> tuple[np.ndarray, np.ndarray]:
    """Checks a CSR checkpoint list against concrete rows; returns (i32[N + 1], i32[M]).

    Both None means no checkpoints. Row n's offsets must be strictly ascending inside (0, query_len); entries past
    `checkpoint_cu[N]` must be padding (`PAD_CHECKPOINT_OFFSET`).
    """
    cu = check_rows(cu_seqlens)
    num_rows = cu.size - 1
    if checkpoint_cu is None and checkpoint_offsets is None:
        return np.zeros(num_rows + 1, np.int32), np.zeros(0, np.int32)
    if checkpoint_cu is None or checkpoint_offsets is None:
        raise ValueError("checkpoint_cu and checkpoint_offsets: give both or neither")
    offsets = check_int_array(checkpoint_offsets, name="checkpoint_offsets")
    ccu = _check_csr(checkpoint_cu, num_rows=num_rows, num_entries=offsets.size)
    counts = np.diff(ccu)
    real = offsets[:ccu[-1]]
    rows = np.repeat(np.arange(num_rows), counts)  # row of each real entry
    query_len = np.diff(cu)[rows]
    outside = (real <= 0) | (real >= query_len)
    unsorted = np.concatenate([[False], (rows[1:] == rows[:-1]) & (real[1:] <= real[:-1])])
    for bad, rule in ((outside, "outside (0, query_len={})"), (unsorted, "must be strictly ascending")):
        if np.any(bad):
            n = int(rows[np.argmax(bad)])
            row = offsets[ccu[n]:ccu[n + 1]].tolist()
            raise ValueError(f"checkpoint_offsets: row {n} offsets {row} {rule.format(int(cu[n + 1] - cu[n]))}")
    padding = offsets[ccu[-1]:]
    if np.any(padding != PAD_CHECKPOINT_OFFSET):
        raise ValueError(f"checkpoint_offsets: padded entries (past checkpoint_cu[N]={ccu[-1]}) must be "
                         f"PAD_CHECKPOINT_OFFSET={PAD_CHECKPOINT_OFFSET}")
    return ccu.astype(np.int32), offsets.astype(np.int32)


def checkpoint_rows(checkpoint_cu, num_checkpoints: int) -> np.ndarray:
    """Row of each CSR entry, i32[M]; -1 for padded entries."""
    num_checkpoints = check_non_negative(num_checkpoints, name="num_checkpoints")
    ccu = _check_csr(checkpoint_cu, num_rows=None, num_entries=None)
    if ccu[-1] > num_checkpoints:
        raise ValueError(f"num_checkpoints: {num_checkpoints} is below checkpoint_cu[N]={ccu[-1]} real checkpoints")
    rows = np.full(num_checkpoints, -1, np.int32)
    counts = np.diff(ccu)
    rows[:ccu[-1]] = np.repeat(np.arange(counts.size, dtype=np.int32), counts)
    return rows


def pad_checkpoints(checkpoint_cu, checkpoint_offsets, size: int, *, checkpoint_state_indices=None):
    """Pads a CSR list to `size` entries with the sentinel offset (and the null slot for `checkpoint_state_indices`)."""
    offsets = check_int_array(checkpoint_offsets, name="checkpoint_offsets")
    real = int(_check_csr(checkpoint_cu, num_rows=None, num_entries=offsets.size)[-1])
    size = check_non_negative(size, name="size")
    if size < real:
        raise ValueError(f"size: {size} is smaller than the number of real checkpoints {real}")
    padded = np.full(size, PAD_CHECKPOINT_OFFSET, np.int32)
    padded[:real] = offsets[:real]
    if checkpoint_state_indices is None:
        return padded
    indices = check_int_array(checkpoint_state_indices, name="checkpoint_state_indices")
    if indices.size < real:
        raise ValueError(f"checkpoint_state_indices: {indices.size} entries for {real} real checkpoints")
    slots = np.full(size, NULL_SLOT, np.int32)
    slots[:real] = indices[:real]
    return padded, slots


def checkpoints_from_rows(offsets, columns=None):
    """Converts vLLM's per-row form (offset 0 / column -1 = none; [N] or [N, K]) to CSR.

    Returns (checkpoint_cu i32[N + 1], checkpoint_offsets i32[M], checkpoint_columns i32[M] or None).
    """
    offs = check_int_array(offsets, name="offsets", ndim=(1, 2))
    if offs.ndim == 1:
        offs = offs[:, None]
    if np.any(offs < 0):
        raise ValueError(f"offsets: must be >= 0 (0 = no checkpoint), got {int(offs.min())}")
    cols = None
    if columns is not None:
        cols = check_int_array(columns, name="columns", ndim=(1, 2))
        if cols.ndim == 1:
            cols = cols[:, None]
        if cols.shape != offs.shape:
            raise ValueError(f"columns: shape {cols.shape} does not match offsets {offs.shape}")
        if np.any(cols < -1):
            raise ValueError(f"columns: must be >= -1 (-1 = no checkpoint), got {int(cols.min())}")
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
    max_per_row = check_positive(max_per_row, name="max_per_row")
    offsets = check_int_array(checkpoint_offsets, name="checkpoint_offsets")
    ccu = _check_csr(checkpoint_cu, num_rows=None, num_entries=offsets.size)
    columns = None
    if checkpoint_columns is not None:
        columns = check_int_array(checkpoint_columns, name="checkpoint_columns")
        if columns.size < ccu[-1]:
            raise ValueError(f"checkpoint_columns: {columns.size} entries for {ccu[-1]} real checkpoints")
    num_rows = ccu.size - 1
    counts = np.diff(ccu)
    if counts.size and counts.max() > max_per_row:
        raise ValueError(f"max_per_row: row has {int(counts.max())} checkpoints, more than {max_per_row}")
    offs = np.zeros((num_rows, max_per_row), np.int32)
    cols = np.full((num_rows, max_per_row), -1, np.int32)
    for n in range(num_rows):
        c = int(counts[n])
        offs[n, :c] = offsets[ccu[n]:ccu[n + 1]]
        if columns is not None:
            cols[n, :c] = columns[ccu[n]:ccu[n + 1]]
    if max_per_row == 1:
        offs, cols = offs[:, 0], cols[:, 0]
    return (offs, cols) if columns is not None else offs


def validate_slots(indices, num_slots: int, *, name: str, allow_null: bool = True) -> np.ndarray:
    """Checks pool slot indices are in [0, num_slots) (or [1, num_slots) when the null slot is not allowed)."""
    num_slots = check_non_negative(num_slots, name="num_slots")
    allow_null = check_flag(allow_null, name="allow_null")
    idx = check_int_array(indices, name=name)
    low = NULL_SLOT if allow_null else NULL_SLOT + 1
    if idx.size and (idx.min() < low or idx.max() >= num_slots):
        bad = idx[(idx < low) | (idx >= num_slots)][0]
        raise ValueError(f"{name}: slot {bad} is outside [{low}, {num_slots}) of the state pool")
    return idx.astype(np.int32)


def map_vllm_slots(indices) -> np.ndarray:
    """vLLM pads slot tables with -1; maps those to the null slot (a -1 in JAX would wrap to the last slot)."""
    idx = check_int_array(indices, name="indices")
    if np.any(idx < -1):
        raise ValueError(f"indices: vLLM slots must be >= -1, got {int(idx.min())}")
    return np.where(idx < 0, NULL_SLOT, idx).astype(np.int32)
