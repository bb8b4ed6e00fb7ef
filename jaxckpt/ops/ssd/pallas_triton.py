"""Chunked Mamba2 SSD as Pallas kernels for the Triton lowering, with prefill checkpoint states.

The math (chunked form, in-chunk checkpoint formula) is in README.md. delta = clamp(softplus(dt + dt_bias)) and the
chunk-local inclusive cumsum Acs of a = delta A are cheap elementwise work and stay in jnp, written chunk-major
[H, NC, C] fp32 (padding slots get delta = 0, so they neither decay nor add input); for fp32 I/O as hi + lo
(`log_decay.split_cumsum`: the error of every exp(Acs_i - Acs_j) below does not grow with the decays before the
pair; 16-bit inputs keep one Acs, whose cancellation is far below their error class). Then four launches:

1. `_local_state_kernel`, grid (chunk, head): S_loc = sum_j exp(Acs_last - Acs_j) delta_j x_j B_j^T as one
   [P, C] x [C, N] dot, written [H, NC, P, N] fp32.
2. `_state_kernel`, grid (row, head, P block): H [P, N] fp32 carried through the row's chunks (count read from the
   chunk table), H <- exp(Acs_last) H + S_loc, writing every chunk-entry state H_c and the row's final state. The
   update is elementwise, so P splits into `state_block_p`-row blocks at no extra work: with one row the pass
   otherwise runs only H programs, each bound by the latency of one chunk's load per step (with whole-P programs
   the pass took half the op on the H200 at T 32768, H 32: bench/README.md, "Pallas Triton"). The loop body is
   straight-line (no checkpoint branches), so outputs and final states cannot depend on the checkpoints.
3. `_checkpoint_kernel`, grid (checkpoint, head), only when M > 0: the state after the first r tokens of chunk c,
   exp(Acs_{r-1}) H_c + sum_{i<r} exp(Acs_{r-1} - Acs_i) delta_i x_i B_i^T (r = 0 gives H_c exactly), read from
   the chunk-entry states of step 2: work only at the chunks that hold checkpoints.
4. `_output_kernel`, grid (chunk, head): y = (L o C B^T)(delta x) + exp(Acs) (C H_c^T) + D x, times silu(z) when
   z is given, with L_ij = exp(Acs_i - Acs_j) masked to j <= i before the exp.

Head h reads B and C of group h // (H // G). Varlen rows and checkpoints come from
`jaxckpt.plan.layout.chunk_layout(..., xp=jnp)` (traced metadata, one compile per shape), passed as int32 refs: the
Triton lowering has no scalar prefetch, so packed token tiles are loaded with `pl.ds(start, C)` and row masks
(other=0). Every tile is a power of two (P, N in [16, 256], C in (16, 32, 64)) and every dot is 2-D.

Precision. fp32 inputs: every dot at Precision.HIGHEST (IEEE fp32). 16-bit x, B and C: the output products take
16-bit operands with fp32 accumulation; the state-building ones (S_loc, checkpoints) take fp32 operands at default
precision. Decays, carried, final and checkpoint states are fp32 throughout; y comes back in x.dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxckpt.ops.common import device
from jaxckpt.ops.common.contract import kernel_dtype_reason, tuning_reason
from jaxckpt.ops.common.log_decay import floor_log_decay, split_cumsum
from jaxckpt.ops.common.pallas_triton_tiles import CumsumRefs, Dots, row_mask
from jaxckpt.ops.common.xla_arrays import check_ssd_inputs, packed_metadata, ssd_delta, ssd_initial_state
from jaxckpt.plan.conventions import check_state_layout
from jaxckpt.plan.layout import chunk_layout

CHUNK_SIZES = (16, 32, 64)
MIN_DIM = 16
MAX_DIM = 256
TUNING_KEYS = ("num_warps", "num_stages", "state_block_p")
_F32 = jnp.float32
_NT = ((1,), (1,))  # a @ b^T
_TN = ((0,), (0,))  # a^T @ b
_NN = ((1,), (0,))  # a @ b


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports(x, dt, B, C, z=None, *, chunk_size=64, interpret=False, **tuning) -> str | None:
    """None when this backend can run the call, else the reason (so the caller can fall back to XLA)."""
    reason = tuning_reason(tuning, TUNING_KEYS, chunk_size=chunk_size, chunk_sizes=CHUNK_SIZES)
    if reason is not None:
        return reason
    if x.ndim != 3 or B.ndim != 3:
        return "x, B: expected [T, H, P] and [T, G, N]"
    for name, size in (("P", x.shape[-1]), ("N", B.shape[-1])):
        if not _is_pow2(size) or not MIN_DIM <= size <= MAX_DIM:
            return f"{name}: must be a power of two in [{MIN_DIM}, {MAX_DIM}] for Triton tiles, got {size}"
    block_p = tuning.get("state_block_p")
    if block_p is not None and not _is_pow2(block_p):
        return f"state_block_p: must be a power of two (capped at P), got {block_p!r}"
    reason = kernel_dtype_reason(dict(x=x, dt=dt, B=B, C=C))
    if reason is not None:
        return reason
    if not interpret and not device.is_gpu():
        return f"backend: the Triton kernels need a GPU (or interpret=True), got {jax.default_backend()!r}"
    return None


def _load_tokens(ref_at, rows, length, shape):
    """Masked load of token rows [start, start + rows.size) of a packed array; rows past `length` read 0."""
    return plt.load(ref_at, mask=row_mask(rows, length, shape), other=0)


def _pick(x, rows, r):
    """Entry r of a register vector x [R] (0 when r is outside): tiles cannot be indexed dynamically."""
    return jnp.sum(jnp.where(rows == r, x, 0.0))


def _local_state_kernel(start_ref, len_ref, x_ref, B_ref, *refs, chunk, reps, split, dots):
    refs = list(refs)
    acs_ref = CumsumRefs.pop(refs, split)
    delta_ref, out_ref = refs
    c, h = pl.program_id(0), pl.program_id(1)
    start, length = start_ref[c], len_ref[c]
    rows = jnp.arange(chunk, dtype=jnp.int32)
    head_dim, state_dim = x_ref.shape[-1], B_ref.shape[-1]
    x = _load_tokens(x_ref.at[pl.ds(start, chunk), h, :], rows, length, (chunk, head_dim)).astype(_F32)
    Bc = _load_tokens(B_ref.at[pl.ds(start, chunk), h // reps, :], rows, length, (chunk, state_dim))
    acs, delta = acs_ref[...], delta_ref[...]  # [C], [C]
    # padding slots add 0 to the cumsum, so Acs_last is the last real token's; the weights are <= 1 for A <= 0
    weights = jnp.exp(acs.map(lambda x: _pick(x, rows, chunk - 1)).gap(acs)) * delta
    out_ref[...] = dots.exact(weights[:, None] * x, Bc.astype(_F32), _TN)


def _state_kernel(first_ref, count_ref, *refs, chunk, block_p, has_initial, split):
    rest = list(refs)
    acs_ref = CumsumRefs.pop(rest, split)
    local_ref = rest.pop(0)
    init_ref = rest.pop(0) if has_initial else None
    states_ref, final_ref = rest
    n, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(j * block_p, block_p)
    state_dim = local_ref.shape[-1]
    S0 = init_ref[n, h, rows, :].astype(_F32) if has_initial else jnp.zeros((block_p, state_dim), _F32)
    first = first_ref[n]

    def chunk_step(i, S):
        c = first + i
        states_ref[h, c, rows, :] = S
        return acs_ref[h, c, chunk - 1].exp() * S + local_ref[h, c, rows, :]

    final_ref[n, h, rows, :] = jax.lax.fori_loop(0, count_ref[n], chunk_step, S0)


def _checkpoint_kernel(ck_chunk_ref, ck_pos_ref, start_ref, len_ref, x_ref, B_ref, *refs, chunk, reps, split, dots):
    refs = list(refs)
    acs_ref = CumsumRefs.pop(refs, split)
    delta_ref, states_ref, out_ref = refs
    m, h = pl.program_id(0), pl.program_id(1)
    c, r = ck_chunk_ref[m], ck_pos_ref[m]
    start, length = start_ref[c], len_ref[c]
    rows = jnp.arange(chunk, dtype=jnp.int32)
    head_dim, state_dim = x_ref.shape[-1], B_ref.shape[-1]
    x = _load_tokens(x_ref.at[pl.ds(start, chunk), h, :], rows, length, (chunk, head_dim)).astype(_F32)
    Bc = _load_tokens(B_ref.at[pl.ds(start, chunk), h // reps, :], rows, length, (chunk, state_dim))
    acs, delta = acs_ref[h, c], delta_ref[h, c]  # [C], [C]
    ref = acs.map(lambda x: _pick(x, rows, r - 1))  # r = 0: ref = 0 and every weight masked: the state is H_c itself
    weights = jnp.exp(jnp.where(rows < r, ref.gap(acs), -jnp.inf)) * delta
    out_ref[...] = ref.exp() * states_ref[h, c] + dots.exact(weights[:, None] * x, Bc.astype(_F32), _TN)


def _output_kernel(start_ref, len_ref, x_ref, B_ref, C_ref, *refs, chunk, reps, has_D, has_z, split, dots):
    rest = list(refs)
    acs_ref = CumsumRefs.pop(rest, split)
    delta_ref, states_ref = rest.pop(0), rest.pop(0)
    D_ref = rest.pop(0) if has_D else None
    z_ref = rest.pop(0) if has_z else None
    (y_ref,) = rest
    c, h = pl.program_id(0), pl.program_id(1)
    start, length = start_ref[c], len_ref[c]
    rows = jnp.arange(chunk, dtype=jnp.int32)
    head_dim, state_dim = x_ref.shape[-1], B_ref.shape[-1]
    g = h // reps

    @pl.when(length > 0)
    def _():
        x = _load_tokens(x_ref.at[pl.ds(start, chunk), h, :], rows, length, (chunk, head_dim))
        Bc = _load_tokens(B_ref.at[pl.ds(start, chunk), g, :], rows, length, (chunk, state_dim))
        Cc = _load_tokens(C_ref.at[pl.ds(start, chunk), g, :], rows, length, (chunk, state_dim))
        acs, delta = acs_ref[...], delta_ref[...]  # [C], [C]
        gaps = acs.map(lambda x: x[:, None]).gap(acs.map(lambda x: x[None, :]))
        L = jnp.exp(jnp.where(rows[:, None] >= rows[None, :], gaps, -jnp.inf))
        scores = L * dots.bulk(Cc, Bc, _NT)  # [C, C]
        y = dots.bulk(scores, delta[:, None] * x.astype(_F32), _NN)
        y = y + acs.exp()[:, None] * dots.bulk(Cc, states_ref[...], _NT)  # [C, P]
        if has_D:
            y = y + D_ref[h, :][None, :] * x.astype(_F32)
        if has_z:
            z = _load_tokens(z_ref.at[pl.ds(start, chunk), h, :], rows, length, (chunk, head_dim)).astype(_F32)
            y = y * z * jax.nn.sigmoid(z)
        plt.store(y_ref.at[pl.ds(start, chunk), h, :], y.astype(y_ref.dtype),
                  mask=row_mask(rows, length, (chunk, head_dim)))


@functools.partial(jax.jit, static_argnames=("dt_limit", "state_layout", "chunk_size", "interpret", "num_warps", "num_stages", "state_block_p"))
def ssd(x, dt, A, B, C, *, D=None, dt_bias=None, z=None, dt_limit=None, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="vk", chunk_size=64, interpret=False,
        num_warps=4, num_stages=2, state_block_p=16):
    """Chunked SSD scan of packed rows with final and checkpoint states, as Pallas Triton launches.

    x                   # [T, H, P]
    dt                  # [T, H] raw: delta = softplus(dt + dt_bias), clamped to dt_limit = (lo, hi) when given
    A, dt_bias          # [H]
    B, C                # [T, G, N], G dividing H
    D                   # [H] or [H, P]; None = 0
    z                   # [T, H, P] gate: y * silu(z)
    initial_state       # [N_rows, H, P, N] ("vk") or [N_rows, H, N, P] ("kv"); None = zeros
    cu_seqlens          # i32[N_rows + 1]; None = one row over all T tokens
    checkpoint_cu       # i32[N_rows + 1] with checkpoint_offsets i32[M]; both None = no checkpoints
    Shapes and options are checked here, metadata values are trusted (callers run `jaxckpt.plan.conventions`).
    Tuning: num_warps, num_stages (every launch), state_block_p (P rows per program of the state pass, capped at P).
    Call `supports` first for tile sizes, dtypes and the backend.

    Returns (y [T, H, P] in x.dtype, final_state fp32 [N_rows, H, P, N], checkpoint_states fp32 [M, H, P, N])
    (states [.., H, N, P] for "kv"). Padding tokens and padded checkpoint entries are zeros.
    """
    check_state_layout(state_layout)
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: must be one of {CHUNK_SIZES}, got {chunk_size!r}")
    (x, dt, A, B, C, D, dt_bias, z), dims = check_ssd_inputs(x, dt, A, B, C, D=D, dt_bias=dt_bias, z=z)
    num_tokens, num_heads, head_dim, num_groups, state_dim = dims
    reps = num_heads // num_groups
    cu, ccu, offsets = packed_metadata(cu_seqlens, checkpoint_cu, checkpoint_offsets, num_tokens)
    num_rows = cu.shape[0] - 1
    num_ckpt = offsets.shape[0]
    init = ssd_initial_state(initial_state, dims, num_rows, state_layout, _F32)
    out_dtype = x.dtype
    io_dtype = jnp.promote_types(jnp.promote_types(x.dtype, B.dtype), C.dtype)
    io_dtype = _F32 if jnp.dtype(io_dtype).itemsize >= 4 else jnp.dtype(io_dtype)
    dots = Dots(io_dtype)
    chunk = chunk_size

    delta = ssd_delta(dt, dt_bias, dt_limit, _F32)  # [T, H]
    if num_tokens == 0:
        # loads need a source row; a padding token past cu_seqlens[-1] = 0 is never read unmasked
        x, B, C, delta = (jnp.zeros((1, *a.shape[1:]), a.dtype) for a in (x, B, C, delta))
        z = None if z is None else jnp.zeros((1, *z.shape[1:]), z.dtype)
    x, B, C = x.astype(io_dtype), B.astype(io_dtype), C.astype(io_dtype)
    padded_tokens = x.shape[0]
    lay = chunk_layout(cu, ccu, offsets, chunk_size=chunk, num_tokens=padded_tokens, xp=jnp)
    num_chunks = lay.chunk_len.shape[0]
    pos = jnp.arange(chunk, dtype=jnp.int32)
    chunk_tokens = jnp.clip(lay.chunk_start[:, None] + pos, 0, padded_tokens - 1)  # i32[NC, C]
    in_chunk = pos < lay.chunk_len[:, None]  # bool[NC, C]
    delta_c = jnp.where(in_chunk[None], delta[chunk_tokens].transpose(2, 0, 1), 0)  # [H, NC, C]
    # padding slots select 0 (their delta = 0 times A = -inf would be NaN); the floor keeps A = -inf an exact reset
    dA = jnp.where(in_chunk[None], floor_log_decay(delta_c * A.astype(_F32)[:, None, None]), 0.0)
    split = io_dtype == _F32
    acs = split_cumsum(dA, axis=-1) if split else (jnp.cumsum(dA, axis=-1),)  # ([H, NC, C] chunk-local,) * (1 or 2)

    full = pl.BlockSpec()
    vec_block = pl.BlockSpec((None, None, chunk), lambda c, h: (h, c, 0))
    state_block = pl.BlockSpec((None, None, head_dim, state_dim), lambda c, h: (h, c, 0, 0))
    chunk_states = jax.ShapeDtypeStruct((num_heads, num_chunks, head_dim, state_dim), _F32)
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    call = functools.partial(pl.pallas_call, compiler_params=params, interpret=interpret)

    local = call(
        functools.partial(_local_state_kernel, chunk=chunk, reps=reps, split=split, dots=dots),
        out_shape=chunk_states, grid=(num_chunks, num_heads),
        in_specs=[full] * 4 + [vec_block] * (len(acs) + 1), out_specs=state_block,
        name="ssd_local_state",
    )(lay.chunk_start, lay.chunk_len, x, B, *acs, delta_c)

    block_p = min(state_block_p, head_dim)
    state_inputs = [lay.row_first_chunk, lay.row_num_chunks, *acs, local] + ([init] if init is not None else [])
    states, final_state = call(
        functools.partial(_state_kernel, chunk=chunk, block_p=block_p, has_initial=init is not None, split=split),
        out_shape=(chunk_states, jax.ShapeDtypeStruct((num_rows, num_heads, head_dim, state_dim), _F32)),
        grid=(num_rows, num_heads, head_dim // block_p), in_specs=[full] * len(state_inputs), out_specs=(full, full), name="ssd_state",
    )(*state_inputs)

    if num_ckpt > 0:
        checkpoint_states = call(
            functools.partial(_checkpoint_kernel, chunk=chunk, reps=reps, split=split, dots=dots),
            out_shape=jax.ShapeDtypeStruct((num_ckpt, num_heads, head_dim, state_dim), _F32),
            grid=(num_ckpt, num_heads), in_specs=[full] * (8 + len(acs)),
            out_specs=pl.BlockSpec((None, None, head_dim, state_dim), lambda m, h: (m, h, 0, 0)),
            name="ssd_checkpoints",
        )(lay.checkpoint_chunk, lay.checkpoint_pos, lay.chunk_start, lay.chunk_len, x, B, *acs, delta_c, states)
        checkpoint_states = jnp.where(lay.checkpoint_valid[:, None, None, None], checkpoint_states, 0)
    else:
        checkpoint_states = jnp.zeros((0, num_heads, head_dim, state_dim), _F32)

    out_inputs = [lay.chunk_start, lay.chunk_len, x, B, C, *acs, delta_c, states]
    out_specs = [full] * 5 + [vec_block] * (len(acs) + 1) + [state_block]
    if D is not None:
        out_inputs.append(jnp.broadcast_to(D.astype(_F32).reshape(num_heads, -1), (num_heads, head_dim)))
        out_specs.append(full)
    if z is not None:
        out_inputs.append(z)
        out_specs.append(full)
    y = call(
        functools.partial(_output_kernel, chunk=chunk, reps=reps, has_D=D is not None, has_z=z is not None,
                          split=split, dots=dots),
        out_shape=jax.ShapeDtypeStruct((padded_tokens, num_heads, head_dim), out_dtype),
        grid=(num_chunks, num_heads), in_specs=out_specs, out_specs=full, name="ssd_output",
    )(*out_inputs)
    # tokens past cu_seqlens[-1] are never written: zero them rather than leak garbage
    y = jnp.where(lay.token_valid[:, None, None], y, 0)[:num_tokens]
    if state_layout == "kv":
        final_state, checkpoint_states = final_state.swapaxes(-1, -2), checkpoint_states.swapaxes(-1, -2)
    return y, final_state, checkpoint_states
