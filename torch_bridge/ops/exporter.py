"""Triton checkpoint exporter: stores each checkpoint's conv window and recurrent state into the state pools.

One program per checkpoint and tile of elements. For the checkpoint at offset p of row n (query start s):
- conv half: the W - 1 raw (pre-conv) inputs before token s + p, oldest first, written to
  `conv_state_pool[slot, c, h]`; when p < W - 1 the oldest entries come from the row's incoming conv state (zeros for
  a fresh row), exactly the conv state `jaxckpt.ops.conv1d.reference` defines;
- recurrent half: the state the prefill kernel emitted for this checkpoint, copied into `recurrent_state_pool[slot]`
  with an optional "kv" <-> "vk" transpose and dtype cast, only the real state elements (a padded page tail is
  untouched).
Padded CSR entries and entries whose slot is the null slot write nothing. Every address is formed in int64, so pools
whose slot offset passes 2^31 elements work.

Everything is validated on the host before the launch (index arguments may be device tensors; they are read back once).
vLLM pads slot tables with -1: every slot argument goes through `torch_bridge.interop.vllm_slots` here, so -1 and
vLLM's null block 0 both become our `NULL_SLOT` and are skipped.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from jaxckpt.plan.conventions import (NULL_SLOT, check_positive, check_state_layout, checkpoint_rows,
                                      validate_checkpoints, validate_cu_seqlens)
from torch_bridge.interop import check_tensor, host_flags, host_ints, vllm_slots

_BLOCK = 512


@triton.jit
def _export_checkpoints_kernel(
    x_ptr, conv_ptr, initial_ptr, source_ptr, pool_ptr,
    cu_seqlens_ptr, offsets_ptr, rows_ptr, slots_ptr, initial_refs_ptr, source_rows_ptr,
    stride_x_t, stride_x_d,
    stride_conv_s, stride_conv_d, stride_conv_w,
    stride_initial_s, stride_initial_d, stride_initial_w,
    stride_source_m, stride_source_h, stride_source_a, stride_source_b,
    stride_pool_s, stride_pool_h, stride_pool_a, stride_pool_b,
    DIM: tl.constexpr, STATE_LEN: tl.constexpr, DIM_A: tl.constexpr, DIM_B: tl.constexpr,
    RECURRENT_SIZE: tl.constexpr, NULL: tl.constexpr, HAS_INITIAL: tl.constexpr, HAS_RECURRENT: tl.constexpr,
    HAS_SOURCE_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    row = tl.load(rows_ptr + j).to(tl.int64)
    slot = tl.load(slots_ptr + j).to(tl.int64)
    live = (row >= 0) & (slot != NULL)
    row = tl.maximum(row, 0)
    offset = tl.load(offsets_ptr + j).to(tl.int64)
    start = tl.load(cu_seqlens_ptr + row).to(tl.int64)

    # Conv half: element e is (channel c, history h); history h is row position q = p - (W - 1) + h.
    c = e // STATE_LEN
    h = e % STATE_LEN
    in_conv = live & (e < DIM * STATE_LEN)
    q = offset - STATE_LEN + h
    values = tl.load(x_ptr + (start + q) * stride_x_t + c * stride_x_d, mask=in_conv & (q >= 0), other=0.0)
    values = values.to(conv_ptr.dtype.element_ty)
    if HAS_INITIAL:
        # The incoming state holds row positions -(W - 1) .. -1, so position q < 0 is its entry q + W - 1 = p + h.
        ref = tl.load(initial_refs_ptr + row).to(tl.int64)
        from_initial = in_conv & (q < 0) & (ref >= 0)
        old = tl.load(initial_ptr + ref * stride_initial_s + c * stride_initial_d + (offset + h) * stride_initial_w,
                      mask=from_initial, other=0.0)
        values = tl.where(q >= 0, values, old.to(conv_ptr.dtype.element_ty))
    tl.store(conv_ptr + slot * stride_conv_s + c * stride_conv_d + h * stride_conv_w, values, mask=in_conv)

    if HAS_RECURRENT:
        # Element e is (head, a, b) in the pool's layout; the source strides arrive permuted when layouts differ.
        head = e // (DIM_A * DIM_B)
        a = (e // DIM_B) % DIM_A
        b = e % DIM_B
        in_state = live & (e < RECURRENT_SIZE)
        if HAS_SOURCE_ROWS:
            source_row = tl.load(source_rows_ptr + j).to(tl.int64)
        else:
            source_row = j
        state = tl.load(source_ptr + source_row * stride_source_m + head * stride_source_h + a * stride_source_a
                        + b * stride_source_b, mask=in_state, other=0.0)
        tl.store(pool_ptr + slot * stride_pool_s + head * stride_pool_h + a * stride_pool_a + b * stride_pool_b,
                 state.to(pool_ptr.dtype.element_ty), mask=in_state)


def _device_ints(array, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(array, dtype=np.int32), device=device)


def _check_tensor(t, *, name: str, ndim: int, device: torch.device, shape: str) -> torch.Tensor:
    check_tensor(t, device, name=name, device_of="x")
    if t.ndim != ndim:
        raise ValueError(f"{name}: expected {shape}, got shape {tuple(t.shape)}")
    return t


def _check_writable(t: torch.Tensor, *, name: str) -> None:
    # A zero stride on a dimension of size > 1 would make two programs write one element.
    if any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride())):
        raise ValueError(f"{name}: must not overlap itself (zero stride in {tuple(t.stride())})")


def export_checkpoints(x, conv_state_pool, cu_seqlens, checkpoint_cu, checkpoint_offsets, checkpoint_state_indices,
                       *, conv_width: int | None = None, initial_conv_states=None, initial_state_indices=None,
                       has_initial_state=None, recurrent_checkpoints=None, recurrent_state_pool=None,
                       recurrent_row_ids=None, source_layout: str = "kv", state_layout: str = "kv",
                       alignment: int | None = None) -> None:
    """Writes every real checkpoint's conv window and recurrent state into its pool slot; returns nothing.

    x [T, D] raw pre-conv inputs, any strides (e.g. a column band of a fused projection, stride(0) > D);
    conv_state_pool [S, D, >= W - 1], any strides: a pool stored [S, W - 1, D] is passed as `.transpose(1, 2)`;
    only its first W - 1 entries per channel are written (vLLM widens the row by num_speculative_tokens);
    cu_seqlens i32[N + 1] (None = one row over all T); checkpoint_cu i32[N + 1], checkpoint_offsets i32[M] (CSR);
    checkpoint_state_indices i32[M] pool slot per entry (null or -1 = do not write).

    conv_width: W (default: conv_state_pool.shape[2] + 1).
    initial_conv_states: the rows' incoming conv states, read when an offset is below W - 1: [N, D, >= W - 1], or a
    pool [S', D, >= W - 1] with initial_state_indices i32[N] (null or -1 = fresh row, zeros). None = zeros.
    has_initial_state: bool[N]; False rows read zeros (vLLM's fresh prefill rows).
    recurrent_checkpoints: [M, HV, K, V] ("kv") or [M, HV, V, K] ("vk") by source_layout, one state per entry; or
    [C, ...] all chunk states with recurrent_row_ids i32[M] picking each entry's. recurrent_state_pool [S, HV, ., .]
    in state_layout, any strides (a view into padded pages works). Both None: conv half only.
    alignment: if given, every real offset must be a multiple of it (the spec's prefill_checkpoint_alignment).
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    device = x.device
    _check_tensor(x, name="x", ndim=2, device=device, shape="[T, D]")
    num_tokens, dim = x.shape
    _check_tensor(conv_state_pool, name="conv_state_pool", ndim=3, device=device, shape="[S, D, W - 1]")
    _check_writable(conv_state_pool, name="conv_state_pool")
    num_slots = conv_state_pool.shape[0]
    if conv_state_pool.shape[1] != dim:
        raise ValueError(f"conv_state_pool: expected [S, D, W - 1] with D={dim}, got shape "
                         f"{tuple(conv_state_pool.shape)}")
    width = conv_state_pool.shape[2] + 1 if conv_width is None else check_positive(conv_width, name="conv_width")
    state_len = width - 1
    if not 1 <= state_len <= conv_state_pool.shape[2]:
        raise ValueError(f"conv_width: W - 1 = {state_len} must be in [1, {conv_state_pool.shape[2]}] "
                         "(conv_state_pool's last dimension)")

    cu = validate_cu_seqlens(None if cu_seqlens is None else host_ints(cu_seqlens, name="cu_seqlens"), num_tokens)
    num_rows = cu.size - 1
    ccu, offsets = validate_checkpoints(host_ints(checkpoint_cu, name="checkpoint_cu"),
                                        host_ints(checkpoint_offsets, name="checkpoint_offsets"), cu)
    num_entries = offsets.size
    num_real = int(ccu[-1])
    slots = vllm_slots(checkpoint_state_indices, num_slots, num_entries, name="checkpoint_state_indices",
                       per="checkpoint entry")
    slots[num_real:] = NULL_SLOT
    written = slots[:num_real][slots[:num_real] != NULL_SLOT]
    if np.unique(written).size != written.size:
        raise ValueError("checkpoint_state_indices: two checkpoints write the same slot")
    if alignment is not None:
        check_positive(alignment, name="alignment")
        bad = offsets[:num_real] % alignment != 0
        if np.any(bad):
            raise ValueError(f"checkpoint_offsets: offset {int(offsets[:num_real][bad][0])} is not a multiple of "
                             f"the alignment {alignment}")

    has_initial = initial_conv_states is not None
    initial_refs = np.full(num_rows, -1, np.int64)
    if has_initial:
        _check_tensor(initial_conv_states, name="initial_conv_states", ndim=3, device=device, shape="[N, D, W - 1]")
        if initial_conv_states.shape[1] != dim or initial_conv_states.shape[2] < state_len:
            raise ValueError(f"initial_conv_states: expected [N or S, D={dim}, >= W - 1 = {state_len}], got shape "
                             f"{tuple(initial_conv_states.shape)}")
        if initial_state_indices is None:
            if initial_conv_states.shape[0] != num_rows:
                raise ValueError(f"initial_conv_states: expected one state per row (N={num_rows}) without "
                                 f"initial_state_indices, got {initial_conv_states.shape[0]}")
            initial_refs = np.arange(num_rows, dtype=np.int64)
        else:
            idx = vllm_slots(initial_state_indices, initial_conv_states.shape[0], num_rows,
                             name="initial_state_indices", per="row")
            if np.intersect1d(written, idx[idx != NULL_SLOT]).size:
                raise ValueError("checkpoint_state_indices: a checkpoint slot is also a row's initial-state slot")
            initial_refs = np.where(idx == NULL_SLOT, -1, idx).astype(np.int64)
        if has_initial_state is not None:
            flags = host_flags(has_initial_state, num_rows, name="has_initial_state")
            initial_refs = np.where(flags, initial_refs, -1)
    elif initial_state_indices is not None or has_initial_state is not None:
        raise ValueError("initial_conv_states: required when initial_state_indices or has_initial_state is given")

    has_recurrent = recurrent_checkpoints is not None
    if has_recurrent != (recurrent_state_pool is not None):
        raise ValueError("recurrent_checkpoints and recurrent_state_pool: give both or neither")
    check_state_layout(source_layout)
    check_state_layout(state_layout)
    source_rows = None
    if has_recurrent:
        _check_tensor(recurrent_checkpoints, name="recurrent_checkpoints", ndim=4, device=device,
                      shape=f"[M, HV, {'K, V' if source_layout == 'kv' else 'V, K'}]")
        _check_tensor(recurrent_state_pool, name="recurrent_state_pool", ndim=4, device=device,
                      shape=f"[S, HV, {'K, V' if state_layout == 'kv' else 'V, K'}]")
        _check_writable(recurrent_state_pool, name="recurrent_state_pool")
        if recurrent_state_pool.shape[0] != num_slots:
            raise ValueError(f"recurrent_state_pool: has {recurrent_state_pool.shape[0]} slots, conv_state_pool has "
                             f"{num_slots} (one slot index addresses both)")
        source_shape = tuple(recurrent_checkpoints.shape[1:])
        if source_layout != state_layout:
            source_shape = (source_shape[0], source_shape[2], source_shape[1])
        if source_shape != tuple(recurrent_state_pool.shape[1:]):
            raise ValueError(f"recurrent_checkpoints: state shape {tuple(recurrent_checkpoints.shape[1:])} "
                             f"({source_layout}) does not match recurrent_state_pool "
                             f"{tuple(recurrent_state_pool.shape[1:])} ({state_layout})")
        if recurrent_row_ids is None:
            if recurrent_checkpoints.shape[0] != num_entries:
                raise ValueError(f"recurrent_checkpoints: expected one state per checkpoint entry (M={num_entries}) "
                                 f"without recurrent_row_ids, got {recurrent_checkpoints.shape[0]}")
        else:
            ids = host_ints(recurrent_row_ids, name="recurrent_row_ids")
            if ids.size != num_entries:
                raise ValueError(f"recurrent_row_ids: needs one row per checkpoint entry ({num_entries}), "
                                 f"got {ids.size}")
            real = ids[:num_real]
            if real.size and (real.min() < 0 or real.max() >= recurrent_checkpoints.shape[0]):
                raise ValueError(f"recurrent_row_ids: must be in [0, {recurrent_checkpoints.shape[0]}) for real "
                                 f"checkpoints, got {real.tolist()}")
            source_rows = np.where(np.arange(num_entries) < num_real, ids, 0)
    elif recurrent_row_ids is not None:
        raise ValueError("recurrent_row_ids: needs recurrent_checkpoints")

    if not written.size:
        return
    rows = checkpoint_rows(ccu, num_entries)
    initial = initial_conv_states if has_initial else conv_state_pool
    if has_recurrent:
        source, pool = recurrent_checkpoints, recurrent_state_pool
        source_strides = list(source.stride())
        if source_layout != state_layout:
            source_strides[2], source_strides[3] = source_strides[3], source_strides[2]
        _, num_heads, dim_a, dim_b = pool.shape
    else:
        source, pool = conv_state_pool, conv_state_pool
        source_strides, num_heads, dim_a, dim_b = [0, 0, 0, 0], 0, 1, 1
    pool_strides = pool.stride() if has_recurrent else (0, 0, 0, 0)
    recurrent_size = num_heads * dim_a * dim_b
    grid = (num_entries, triton.cdiv(max(dim * state_len, recurrent_size), _BLOCK))
    _export_checkpoints_kernel[grid](
        x, conv_state_pool, initial, source, pool,
        *(_device_ints(a, device) for a in (cu, offsets, rows, slots, initial_refs,
                                             np.zeros(num_entries) if source_rows is None else source_rows)),
        *x.stride(), *conv_state_pool.stride(), *initial.stride(), *source_strides, *pool_strides,
        DIM=dim, STATE_LEN=state_len, DIM_A=dim_a, DIM_B=dim_b, RECURRENT_SIZE=recurrent_size, NULL=NULL_SLOT,
        HAS_INITIAL=has_initial, HAS_RECURRENT=has_recurrent, HAS_SOURCE_ROWS=source_rows is not None,
        BLOCK=_BLOCK,
    )
