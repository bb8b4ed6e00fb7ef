"""Mamba2's SSD on Pallas Mosaic GPU (Hopper: wgmma, TMA, warp specialization; `interpret=True` on CPU), exporting
checkpoint states from inside the one pass that computes the outputs. Written against jax 0.11.2 (`plgpu.kernel`,
Lane lowering semantics, `num_threads` / `thread_name`); check this module when jax moves.

The math (chunked form, in-chunk checkpoints) is in README.md. What makes SSD different from the delta rules: the
state recurrence per chunk, S <- exp(Acs_last) S + S_loc, has no product with S on it, so the chain from one
chunk's state to the next is one wgmma accumulate plus a scalar scale, and everything else (scores, outputs) is off
the chain. So one kernel walks a *lane* (a contiguous range of one row's chunks, from a start state), keeps the
state in registers and writes outputs, the final state and checkpoint states; nothing per chunk goes to memory
but y.

Per grid point (lane, head h, column block j of BP = 64 of P), one CTA of three warpgroups, carrying the mamba
layout S [BP, N] fp32 in registers (WGMMA layout, N = d_state on the columns, as N / 64 pieces of 64 columns):
- memory (last warpgroup, registers lowered): a TMA ring (2 to 4 slots) of the chunk's x[:, cols] [C, BP],
  B [C, N] and C [C, N] (group h // (H / G)), each as [C, 64] pieces, read straight from the packed token arrays at
  the chunk's first token ("Token layout" below), and its Acs and delta rows [C] fp32. With the gate, z[:, cols]
  [C, BP] goes to two tiles of its own, outside the ring ("SMEM" below): once both consumers have freed chunk i,
  z's tile i % 2 takes chunk i + 2.
- state (warpgroup 0): with w_j = exp(Acs_last - Acs_j) delta_j,
      S <- exp(Acs_last) S + (x^T w) B                      (A = x^T w [BP, C] from registers, B = the B pieces)
  x^T comes from a transposed load of the x tile; x^T w is split into 16-bit hi + lo (two wgmmas per accumulator),
  so the carried state only sees fp32 accumulation rounding (x and B are exact 16-bit inputs).
  Before issuing the update it publishes S rounded to 16 bits (S_hi) into one of two SMEM slots for the output
  warpgroup. Checkpoints: a chunk with ck_count[c] > 0 forms, for each of its checkpoints at chunk position r,
  exp(Acs_{r-1}) S + (x^T w_r) B with w_r,j = exp(Acs_{r-1} - Acs_j) delta_j for j < r, else 0 (r = 0: S itself),
  before the update, and stores it fp32 straight from registers. The carried S never depends on checkpoints.
- output (warpgroup 1): scores = C B^T (wgmma, both operands SMEM), P = scores * exp(Acs_i - Acs_j) delta_j kept
  by a select on j <= i and j < the chunk's length, rounded to 16 bits; then y = exp(Acs_i) (C S_hi^T) + P x (two
  accumulators, issued together; P from registers), staged in SMEM and TMA-stored into y [T, H, P] at the chunk's
  tokens. With D, D x (x from the ring's tile) is added, then with z the gate y <- y z sigmoid(z) (z from its
  own tile), both in fp32 before y is rounded: y is rounded to 16 bits once, as by the Triton SSD, where a gate
  after the kernel would round it twice (rel-RMS against float64 1.7e-3 instead of 2.4e-3 in the interpreter test
  where D x dominates y), and no pass reads y and z again. D x and z sigmoid(z) need no product, so they are formed
  while the chunk's two output wgmmas run, and sigmoid takes no IEEE divide (1 / u as rsqrt(u)^2, u = 1 + exp(-z)
  >= 1): serial and with a divide, this epilogue cost several times the extra read of z (bench/README.md, "SSD's
  gated epilogue"). Exps are ex2.approx (`approx_math`; one MUFU op and a multiply, as the Triton kernels' exp2).
  Precision as mamba_ssm's and FLA's chunk scans: the output products take the state and P in 16 bits with fp32
  accumulation.
Ring slots are refilled once both consumers have released them (`in_free`, two arrivals), and so are z's tiles
(the output warpgroup reads chunk i's z before it releases chunk i; `z_bar` says a z tile landed); published S slots
are reused once the output warpgroup has read them (`s_free`). All warpgroups meet at a final barrier (a warpgroup
exiting while another still issues wgmmas has faulted on sm_90 with jax 0.11.2) and every waiter observes every
phase of its barriers (the interpreter checks it).

Token layout. Chunks start wherever their row puts them, and Mosaic GPU issues a TMA between GMEM and an (8, 64)-
tiled SMEM tile over the GMEM array tiled the same way, which drops rows at a start off the 8-row grid
(`jaxckpt.ops.delta_rule.pallas_mosaic_gpu.pipeline` docstring, "TMA addresses"). A TMA into an *untiled*
128-byte-swizzled tile has no such limit, and for 64 two-byte columns (one 128-byte row) the untiled and the tiled
layouts are the same bytes. So every operand tile is a [C, 64] piece allocated once as a `plgpu.RefUnion` of an untiled
view (the TMA target) and a tiled view (the wgmma operand), and y leaves the same way: no chunk-major copies, no
gathers. Checked on the H200 (a TMA at row 13 read back through the tiled view by a wgmma) and by the GPU tests; Mosaic
GPU's interpreter keeps the two views apart, so under `interpret` the TMAs use the tiled view directly (the interpreter
copies any rows) and the token arrays get C zero rows appended (its TMA would clamp a box past the end; the GPU
fills such rows with zeros). Rows of a chunk past its length hold the next row's tokens, padding (possibly NaN) or
zeros: the state warpgroup masks x^T by a select and zeroes those rows of the B pieces in SMEM, the output
warpgroup zeroes them in the x tile (a tensor-core product turns 0 * NaN into NaN) and masks P's columns; z's
tile needs nothing (the gate is elementwise, so those rows stay in rows of y that are never stored). A row's
last, partial chunk leaves through a plain SMEM tile as TMA boxes of 32, 16, ..., 1 rows (a TMA store cannot be
masked); the CTAs of one extra, empty lane write zeros over the padding tokens past the last row.

Sequence split (`pieces`). A lane runs its chunks in order, so one row and few heads leave SMs idle ((1, 32768,
32) at P = 64: 32 CTAs on 132 SMs). As for the delta rules (`delta_rule.pallas_mosaic_gpu.split`), every row is cut into
`pieces` contiguous lanes. Here a piece's state map is S_end = m S_start + E with m = exp(sum of the piece's Acs_last)
a scalar per head, so: (1) a state-only pass (no output warpgroup, no C tile) gives E for pieces 0 .. pieces-2 from
zero states, (2) XLA scans start_{p+1} = m_p start_p + E_p (pieces - 1 elementwise steps, fp32; m_p from a
segment sum of the chunks' Acs_last), (3) the main pass runs all lanes from their starts. Exact up to fp32
rounding. `choose_pieces`: 1 when rows x heads x P / 64 already fill half the SMs, else the largest power of two
up to 8 whose main pass fits in one wave of CTAs, keeping >= 8 chunks per piece on average.

SMEM (227 KB per CTA on sm_90). At N = 128, BP = 64, bf16: a ring slot holds x 8 KB + B 16 KB + C 16 KB + 512 B
of rows (state-only pass: 24.5 KB), beside two published S_hi tiles (32 KB) and the y staging and partial-chunk
tiles (16 KB): 4 slots take 210 KB. Why z is not in the ring: the state warpgroup runs up to two chunks ahead of
the output warpgroup (two S_hi slots), so 4 slots hold the output's chunk, the state's two and one landing; z in
every slot (48.5 KB a slot) left room for 3, which measured far slower on the H200 than the kernel without z
(bench/README.md, kernel-level runs). z's own two tiles (16 KB) fit beside the 4 slots: 226.1 KB with the barriers,
0.9 KB to spare (`_stages` counts it; the lowering test exports for CUDA, where Mosaic GPU checks the bytes). Two,
not one: chunk i + 2's z starts landing when chunk i is freed, a whole chunk of output work before its gate (with
one tile, only as the gate's own chunk begins). At N = 64 every arrangement keeps 4 slots.

Interpret mode: Mosaic GPU's interpreter (jax 0.11.2) reads a wgmma's A operand only from SMEM, so under
`interpret` register operands take a detour through scratch tiles; its wgmma is an fp32 matmul of the 16-bit
tiles: the interpreter checks the algorithm, not the tensor-core rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxckpt.ops.common import device
from jaxckpt.ops.common import pallas_mosaic_gpu_tiles as tiles
from jaxckpt.ops.common.checkpoint_chunks import checkpoint_ranges, split_lanes
from jaxckpt.ops.common.configs import MAX_SSD_PIECES
from jaxckpt.ops.common.contract import kernel_dtype_reason
from jaxckpt.ops.common.log_decay import floor_log_decay
from jaxckpt.ops.common.xla_arrays import check_ssd_inputs, packed_metadata, ssd_delta, ssd_initial_state
from jaxckpt.plan.conventions import check_state_layout
from jaxckpt.plan.layout import chunk_layout, searchsorted

CHUNK = 64
BLOCK_P = 64
PIECE = 64  # columns of every SMEM operand tile: one 128-byte swizzle row at 16 bits
HEAD_DIMS = (64, 128)  # P (blocks of 64) and N (the registers of the carried [64, N] fp32 state)
DTYPES = (jnp.bfloat16, jnp.float16)
TUNING_KEYS = ("pieces", "stages")
MAX_PIECES = 8
MIN_CHUNKS_PER_PIECE = 8
MAX_GRID_Z = 65535  # lanes: the grid's first axis, CUDA's z (Mosaic GPU reverses the grid)
_F32 = jnp.float32
_WG = plgpu.Layout.WGMMA
_ROW = _WG.reduce(1)
_COL = _WG.reduce(0)
_PUBLISH = 2  # published S_hi slots
_Z_SLOTS = 2  # z tiles, outside the TMA ring (module docstring, "SMEM")
_STATE, _OUTPUT = 0, 1


def supports(x, dt, B, C, z=None, *, chunk_size=64, interpret=False, cu_seqlens=None, **tuning) -> str | None:
    """None when this backend can run the call, else the reason (so the caller can fall back). An option given as
    None means its default; `cu_seqlens` (only its shape is read) gives the row count for the grid check."""
    tuning = {key: value for key, value in tuning.items() if value is not None}
    unknown = sorted(set(tuning) - set(TUNING_KEYS))
    if unknown:
        return f"tuning: unknown options {unknown}, expected some of {TUNING_KEYS}"
    pieces = tuning.get("pieces", "auto")
    if pieces != "auto" and not (isinstance(pieces, (int, np.integer)) and 1 <= pieces <= MAX_SSD_PIECES):
        return f"pieces: must be 'auto' or an int in [1, {MAX_SSD_PIECES}], got {pieces!r}"
    if tuning.get("stages") not in (None, 2, 3, 4):
        return f"stages: must be 2, 3 or 4, got {tuning['stages']!r}"
    if chunk_size != CHUNK:
        return f"chunk_size: the Mosaic GPU SSD runs {CHUNK}-token chunks (wgmma tiles), got {chunk_size!r}"
    rows = 1 if cu_seqlens is None else np.shape(cu_seqlens)[0] - 1
    lanes = rows * (MAX_PIECES if pieces == "auto" else pieces) + 1
    if lanes > MAX_GRID_Z:
        return f"cu_seqlens: {rows} rows x pieces + 1 = {lanes} lanes exceed the grid's {MAX_GRID_Z} (CUDA's z axis)"
    if x.ndim != 3 or B.ndim != 3 or C.shape != B.shape:
        return "x, B, C: expected [T, H, P], [T, G, N], [T, G, N]"
    reason = (tiles.wgmma_reason(dict(P=x.shape[-1], N=B.shape[-1]), dict(x=x, B=B, C=C),
                                 fallback=" (float32 inputs: use pallas_triton or xla)")
              or kernel_dtype_reason(dict(dt=dt)))
    if reason is not None:
        return reason
    if z is not None and (z.shape != x.shape or z.dtype != x.dtype):
        return (f"z: the fused gate reads z through x's TMA tiles, so it needs x's shape and dtype {x.shape} "
                f"{x.dtype}, got {z.shape} {z.dtype}")
    if not interpret and not device.is_hopper():
        return "backend: the Mosaic GPU SSD needs a Hopper GPU (sm_90, wgmma) or interpret=True"
    return None


def _stages(head_n, dtype, *, has_output, has_z=False, stages=None):
    size = jnp.dtype(dtype).itemsize
    per_stage = CHUNK * (BLOCK_P + (2 if has_output else 1) * head_n) * size + 2 * 4 * CHUNK
    fixed = 0
    if has_output:  # published S_hi, the y staging and partial-chunk tiles, the z tiles
        fixed = (_PUBLISH * BLOCK_P * head_n + (2 + (_Z_SLOTS if has_z else 0)) * CHUNK * BLOCK_P) * size
    fixed += 1024  # barriers and the 1024-byte alignment of the [stages, C] fp32 row tiles
    return tiles.ring_depth(per_stage, fixed, stages=stages, what=f"at N = {head_n}" + (" with z" if has_z else ""))


def _zero_rows(tile, length):
    """Rows >= length of an SMEM tile [C, 64] set to 0 (a select: NaN there stays out of the tensor-core products,
    where 0 * NaN would be NaN)."""
    rows = tiles.iota((CHUNK, PIECE), 0)
    tile[...] = jnp.where(rows < length, tiles.load(tile), jnp.zeros((), tile.dtype))
    plgpu.commit_smem()


def _ssd_kernel(*refs, reps, stages, has_output, has_init, has_checkpoints, has_D, has_z, interpret, pad_lane, **s):
    refs = list(refs)
    take = lambda count: [refs.pop(0) for _ in range(count)]  # noqa: E731
    first_ref, count_ref, start_ref, len_ref, acs_ref, delta_ref, x_ref, b_ref = take(8)
    c_ref, pad_ref = take(2) if has_output else (None, None)
    z_ref = refs.pop(0) if has_z else None
    D_ref = refs.pop(0) if has_D else None
    init_ref = refs.pop(0) if has_init else None
    ck_start_ref, ck_count_ref, ck_pos_ref = take(3) if has_checkpoints else (None, None, None)
    y_ref = refs.pop(0) if has_output else None
    end_ref = refs.pop(0)
    ckpt_ref = refs.pop(0) if has_checkpoints else None
    land, ring = s["ring"]  # the same SMEM: TMA lands in `land` (untiled), wgmmas read `ring` (tiled)
    z_land, z_s = s["z_tiles"] if has_z else (None, None)  # the same two views
    acs_s, delta_s, in_bar, in_free = s["acs_s"], s["delta_s"], s["in_bar"], s["in_free"]
    x_s, b_s = ring["x"], ring["b"]

    lane, h, j = lax.axis_index("l"), lax.axis_index("h"), lax.axis_index("j")
    wg = lax.axis_index("wg")
    g = lax.div(h, reps)
    pieces = b_s.shape[1]  # N / 64
    dtype = x_s.dtype
    first, count = first_ref[lane], count_ref[lane]
    num_chunks = start_ref.shape[0]
    cols = pl.ds(j * BLOCK_P, BLOCK_P)
    half_shape = (BLOCK_P, PIECE)  # one 64-column piece of the state S [BP, N]
    memory_wg = 2 if has_output else 1
    detour = lambda name: s.get(name)  # noqa: E731  (interpret only)
    # the interpreter copies any rows into tiled SMEM; the GPU needs the untiled landing views for that
    target = ring if interpret else land
    z_target = z_s if interpret else z_land

    @pl.when(wg == memory_wg)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def issue(c, slot):
            bar, rows = in_bar.at[slot], pl.ds(start_ref[c], CHUNK)
            plgpu.copy_gmem_to_smem(x_ref.at[rows, h, cols], target["x"].at[slot], bar)
            for k in range(pieces):
                piece = pl.ds(k * PIECE, PIECE)
                plgpu.copy_gmem_to_smem(b_ref.at[rows, g, piece], target["b"].at[slot, k], bar)
                if has_output:
                    plgpu.copy_gmem_to_smem(c_ref.at[rows, g, piece], target["c"].at[slot, k], bar)
            plgpu.copy_gmem_to_smem(acs_ref.at[h, c], acs_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(delta_ref.at[h, c], delta_s.at[slot], bar)
            if has_z:
                # the first two chunks' z have empty tiles to land in; later ones wait for a freed tile (`z_after`)
                @pl.when(c - first < _Z_SLOTS)
                def _():
                    issue_z(c - first)

        def issue_z(i):
            half = lax.rem(i, _Z_SLOTS)
            plgpu.copy_gmem_to_smem(z_ref.at[pl.ds(start_ref[first + i], CHUNK), h, cols], z_target.at[half],
                                    s["z_bar"].at[half])

        def z_after(i):
            """Once both consumers are done with the lane's chunk i, starts chunk i + 2's z into z's tile i % 2:
            the output warpgroup read chunk i's z before it released chunk i."""
            @pl.when(i + _Z_SLOTS < count)
            def _():
                issue_z(i + _Z_SLOTS)

        tiles.fill_ring(first, count, stages, in_free, issue, on_free=z_after if has_z else None)

    @pl.when(wg == _STATE)
    def _state():
        plgpu.set_max_registers(232, action="increase")
        if has_init:
            start = tiles.lane_state(lane, pad_lane)
            S0 = tuple(tiles.load(init_ref.at[start, h, cols, pl.ds(k * PIECE, PIECE)]) for k in range(pieces))
        else:
            S0 = tuple(plgpu.layout_cast(jnp.zeros(half_shape, _F32), _WG) for _ in range(pieces))
        tile_t = (BLOCK_P, CHUNK)  # x^T
        token = tiles.iota(tile_t, 1)

        def update(S, decay, x_w, slot, during=None):
            """decay * S + (x_w) B, x_w = x^T with its token columns weighted, as hi + lo register operands."""
            hi, lo = tiles.split(x_w, dtype, 2)
            a_hi, a_lo = tiles.lhs(hi, detour("xw_hi_d")), tiles.lhs(lo, detour("xw_lo_d"))
            added = tiles.matmuls(*((half_shape, ((a_hi, b_s.at[slot, k]), (a_lo, b_s.at[slot, k])))
                                    for k in range(pieces)), during=during)
            return tuple(decay * S_k + a for S_k, a in zip(S, added))

        def checkpoints(c, slot, S, x_t, acs, delta):
            def one(m, carry):
                r = ck_pos_ref[m]
                acs_r = acs_s[slot, jnp.maximum(r - 1, 0)]
                decay = jnp.exp(jnp.where(r > 0, acs_r, 0.0))  # r = 0: no tokens, S itself
                weights = jnp.exp(jnp.where(token < r, acs_r - acs, -jnp.inf)) * delta
                for k, state in enumerate(update(S, decay, x_t * weights, slot)):
                    ckpt_ref.at[m, h, cols, pl.ds(k * PIECE, PIECE)][...] = state
                return carry

            start = ck_start_ref[c]
            lax.fori_loop(start, start + ck_count_ref[c], one, 0)

        def step(i, carry):
            S, length, has_ck = carry
            c, slot, half = first + i, lax.rem(i, stages), lax.rem(i, _PUBLISH)
            # the next chunk's table entries: global loads that this chunk's work hides
            length_next, has_ck_next = ahead(c + 1)
            plgpu.barrier_wait(in_bar.at[slot])

            @pl.when(length < CHUNK)
            def _():
                # this warpgroup's products read B whole; the output warpgroup's scores mask its columns by a select
                for k in range(pieces):
                    _zero_rows(b_s.at[slot, k], length)

            acs = tiles.by_col(tiles.load(acs_s.at[slot], _COL), tile_t)
            delta = tiles.by_col(tiles.load(delta_s.at[slot], _COL), tile_t)
            acs_last = acs_s[slot, CHUNK - 1]  # padding slots have delta = 0: the last real token's
            x_t = tiles.load(x_s.at[slot].T).astype(_F32)  # [BP, C]
            x_t = jnp.where(token < length, x_t, 0.0)  # rows past the chunk: the next row's tokens or padding
            if has_checkpoints:
                @pl.when(has_ck)
                def _():
                    checkpoints(c, slot, S, x_t, acs, delta)

            def publish():
                @pl.when(i >= _PUBLISH)
                def _():
                    plgpu.barrier_wait(s["s_free"].at[half])  # the output warpgroup read the slot's last S

                for k in range(pieces):
                    s["s_pub"].at[half, k][...] = S[k].astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(s["s_ready"].at[half])

            S_next = update(S, jnp.exp(acs_last), x_t * (jnp.exp(acs_last - acs) * delta), slot,
                            publish if has_output else None)
            plgpu.barrier_arrive(in_free.at[slot])
            return S_next, length_next, has_ck_next

        def ahead(c):
            c = jnp.minimum(c, num_chunks - 1)
            return len_ref[c], (ck_count_ref[c] > 0) if has_checkpoints else False

        S, _, _ = lax.fori_loop(0, count, step, (S0, *ahead(first)))

        @tiles.real_lanes(lane, pad_lane)
        def _():
            for k in range(pieces):
                end_ref.at[lane, h, cols, pl.ds(k * PIECE, PIECE)][...] = S[k]

        if has_output:
            def drain(i, carry):
                plgpu.barrier_wait(s["s_free"].at[lax.rem(i, _PUBLISH)])
                return carry

            lax.fori_loop(jnp.maximum(count - _PUBLISH, 0), count, drain, 0)

    if has_output:
        @pl.when(wg == _OUTPUT)
        def _output():
            plgpu.set_max_registers(232, action="increase")
            c_s, s_pub = ring["c"], s["s_pub"]
            y_land, y_s = s["y_staging"]
            y_store = y_s if interpret else y_land
            rows_s = s["y_rows"]
            square = (CHUNK, CHUNK)
            below = tiles.iota(square, 0) >= tiles.iota(square, 1)
            out_shape = (CHUNK, BLOCK_P)
            skip = tiles.by_col(tiles.load(D_ref.at[h, cols], _COL), out_shape) if has_D else None  # D x

            def chunk_output(i, length):
                slot, half = lax.rem(i, stages), lax.rem(i, _PUBLISH)
                plgpu.barrier_wait(in_bar.at[slot])

                @pl.when(length < CHUNK)
                def _():
                    _zero_rows(x_s.at[slot], length)  # P x: P's zero columns would not stop a NaN there

                scores = tiles.matmul(square, tuple((c_s.at[slot, k], b_s.at[slot, k].T) for k in range(pieces)))
                acs_i = tiles.load(acs_s.at[slot], _ROW)
                keep = below & (tiles.iota(square, 1) < length)
                decay = jnp.exp(jnp.where(keep, tiles.by_row(acs_i, square)
                                          - tiles.by_col(tiles.load(acs_s.at[slot], _COL), square), -jnp.inf))
                weights = decay * tiles.by_col(tiles.load(delta_s.at[slot], _COL), square)
                p = jnp.where(keep, scores * weights, 0.0).astype(dtype)
                plgpu.barrier_wait(s["s_ready"].at[half])

                def epilogue_terms():
                    """(D x, z silu(z)), each None when not asked for: they need no product, so they run while the
                    wgmmas do."""
                    skip_x = skip * tiles.load(x_s.at[slot]).astype(_F32) if has_D else None
                    gate = None
                    if has_z:
                        # elementwise: a NaN or another row's z in rows past the chunk's length stays in those
                        # rows, which are never stored
                        z_half = lax.rem(i, _Z_SLOTS)
                        plgpu.barrier_wait(s["z_bar"].at[z_half])
                        z = tiles.load(z_s.at[z_half]).astype(_F32)
                        # 1 / u as rsqrt(u)^2 (u >= 1): two MUFU ops where an IEEE divide is a long sequence
                        root = lax.rsqrt(1.0 + jnp.exp(-z))
                        gate = z * (root * root)
                    return skip_x, gate

                inter, intra, (skip_x, gate) = tiles.matmuls(
                    (out_shape, tuple((c_s.at[slot, k], s_pub.at[half, k].T) for k in range(pieces))),
                    (out_shape, ((tiles.lhs(p, detour("p_d")), x_s.at[slot]),)), during=epilogue_terms)
                plgpu.barrier_arrive(s["s_free"].at[half])
                y = tiles.by_row(jnp.exp(acs_i), out_shape) * inter + intra
                if has_D:
                    y = y + skip_x
                if has_z:
                    y = y * gate
                plgpu.barrier_arrive(in_free.at[slot])
                return y.astype(dtype)

            # the tokens past the last row (padding) are written as zeros by the CTAs of the extra last lane
            tiles.token_output(chunk_output, first=first, count=count, chunk_start=start_ref, chunk_len=len_ref,
                               tiled=y_s, whole=y_store, rows_s=rows_s, dst=y_ref.at[:, h, cols], pad=pad_ref,
                               pad_lane=lane == pad_lane)

    plgpu.barrier_arrive(s["done"])
    plgpu.barrier_wait(s["done"])


def ssd_lanes(lane_first, lane_count, chunk_start, chunk_len, acs, delta, x, B, C, lane_init=None, checkpoints=None,
              D=None, z=None, *, interpret=False, stages=None):
    """The SSD scan over L lanes (module docstring), reading the packed token arrays directly.

    lane_first, lane_count  # i32[L]: lane l walks chunks lane_first[l] .. + lane_count[l] - 1 (lanes never share one)
    chunk_start, chunk_len  # i32[NC]: each chunk's first packed token and token count (`ChunkLayout`)
    acs, delta              # fp32 [H, NC, C]: chunk-local inclusive cumsum of delta * A, and delta (padding 0)
    x                       # [T, H, P] 16-bit
    B, C                    # [T, G, N] same dtype; C None: the state-only pass (no outputs)
    lane_init               # fp32 [L, H, P, N] start states, or None (zeros)
    checkpoints             # (ck_start i32[NC], ck_count i32[NC], checkpoint_pos i32[M]) or None
    D                       # fp32 [H, P] skip (y += D x, before y is rounded), or None; only with C
    z                       # [T, H, P] x's dtype: gate y <- y * silu(z) in fp32 after D x, before y is rounded, or
                            # None; only with C
    Returns (y [T, H, P] (None without C; every token of every lane written, tokens past the last lane's last chunk
    zero, others untouched), lane_end fp32 [L, H, P, N], checkpoint_states fp32 [M, H, P, N] or None).
    """
    num_tokens, num_heads, head_p = x.shape
    num_groups, head_n = B.shape[1:]
    if head_p % BLOCK_P or head_n not in HEAD_DIMS:
        raise ValueError(f"x, B: expected P a multiple of {BLOCK_P}, N in {HEAD_DIMS}, got {x.shape}, {B.shape}")
    has_output = C is not None
    has_z = z is not None and has_output
    if has_z and (z.shape != x.shape or z.dtype != x.dtype):
        raise ValueError(f"z: expected x's shape and dtype {x.shape} {x.dtype}, got {z.shape} {z.dtype}")
    has_init = lane_init is not None
    has_checkpoints = checkpoints is not None and checkpoints[2].shape[0] > 0
    dtype = x.dtype
    num_lanes = lane_first.shape[0]
    stages = _stages(head_n, dtype, has_output=has_output, has_z=has_z, stages=stages)
    pieces = head_n // PIECE

    lanes = [lane_first.astype(jnp.int32), lane_count.astype(jnp.int32)]
    if has_output:
        *lanes, pad = tiles.padding_lane(*lanes, chunk_start, chunk_len, num_tokens)
    grid_lanes = lanes[0].shape[0]
    inputs = lanes + [chunk_start.astype(jnp.int32), chunk_len.astype(jnp.int32), acs.astype(_F32),
                      delta.astype(_F32), x, B]
    if has_output:
        inputs += [C, pad]
    inputs += [z] if has_z else []
    has_D = D is not None and has_output
    inputs += [jnp.broadcast_to(D.astype(_F32).reshape(num_heads, -1), (num_heads, head_p))] if has_D else []
    inputs += [lane_init.astype(_F32)] if has_init else []
    inputs += [a.astype(jnp.int32) for a in checkpoints] if has_checkpoints else []
    state_type = lambda rows: jax.ShapeDtypeStruct((rows, num_heads, head_p, head_n), _F32)  # noqa: E731
    out_type = ([jax.ShapeDtypeStruct(x.shape, dtype)] if has_output else []) + [state_type(num_lanes)]
    out_type += [state_type(checkpoints[2].shape[0])] if has_checkpoints else []
    consumers = 2 if has_output else 1
    untiled = lambda shape: plgpu.SMEM(shape, dtype, transforms=(plgpu.SwizzleTransform(128),))  # noqa: E731
    ring_shapes = dict(x=(stages, CHUNK, PIECE), b=(stages, pieces, CHUNK, PIECE))
    if has_output:
        ring_shapes["c"] = (stages, pieces, CHUNK, PIECE)
    # 64 two-byte columns are one 128-byte swizzle row, so the untiled and the (8, 64)-tiled layouts of these tiles
    # are the same bytes (module docstring, "Token layout")
    ring = plgpu.RefUnion({k: untiled(v) for k, v in ring_shapes.items()},
                          {k: tiles.swizzled(v, dtype) for k, v in ring_shapes.items()})
    copies = 1 + (2 if has_output else 1) * pieces + 2
    scratch = dict(
        ring=ring, acs_s=plgpu.SMEM((stages, CHUNK), _F32), delta_s=plgpu.SMEM((stages, CHUNK), _F32),
        in_bar=plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),
        done=plgpu.Barrier(num_arrivals=consumers + 1))
    if has_output:
        scratch.update(s_pub=tiles.swizzled((_PUBLISH, pieces, BLOCK_P, PIECE), dtype),
                       y_staging=plgpu.RefUnion(untiled((CHUNK, BLOCK_P)), tiles.swizzled((CHUNK, BLOCK_P), dtype)),
                       y_rows=plgpu.SMEM((CHUNK, BLOCK_P), dtype),
                       s_ready=plgpu.Barrier(num_barriers=_PUBLISH), s_free=plgpu.Barrier(num_barriers=_PUBLISH))
    if has_z:
        z_shape = (_Z_SLOTS, CHUNK, PIECE)
        scratch.update(z_tiles=plgpu.RefUnion(untiled(z_shape), tiles.swizzled(z_shape, dtype)),
                       z_bar=plgpu.Barrier(num_barriers=_Z_SLOTS))
    if interpret:
        scratch.update(xw_hi_d=tiles.swizzled((BLOCK_P, CHUNK), dtype), xw_lo_d=tiles.swizzled((BLOCK_P, CHUNK), dtype))
        if has_output:
            scratch.update(p_d=tiles.swizzled((CHUNK, CHUNK), dtype))
    body = functools.partial(_ssd_kernel, reps=num_heads // num_groups, stages=stages, has_output=has_output,
                             has_init=has_init, has_checkpoints=has_checkpoints, has_D=has_D, has_z=has_z,
                             interpret=bool(interpret), pad_lane=grid_lanes - 1 if has_output else None)
    kernel = plgpu.kernel(
        body, out_type=tuple(out_type), scratch_types=scratch, grid=(grid_lanes, num_heads, head_p // BLOCK_P),
        grid_names=("l", "h", "j"), num_threads=consumers + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=tiles.interpret_params(interpret), kernel_name="ssd_lanes" if has_output else "ssd_lanes_states")
    outs = list(kernel(*inputs))
    y = outs.pop(0) if has_output else None
    lane_end = outs.pop(0)
    return y, lane_end, (outs.pop(0) if has_checkpoints else None)


def choose_pieces(num_rows, num_heads, head_p, num_tokens, *, num_sms=None) -> int:
    """Pieces per row (module docstring, "Sequence split"): static, from shapes only."""
    num_sms = num_sms or device.num_sms()
    plain = num_rows * num_heads * (head_p // BLOCK_P)
    if num_rows == 0 or 2 * plain > num_sms:
        return 1
    chunks = num_tokens / num_rows / CHUNK
    pieces = 1
    while 2 * pieces <= MAX_PIECES and plain * 2 * pieces <= num_sms and chunks / (2 * pieces) >= MIN_CHUNKS_PER_PIECE:
        pieces *= 2
    return pieces


def _piece_starts(lanes, acs, ends, init, num_rows, pieces):
    """Each lane's start state [N * pieces, H, P, N] from the state-only pass's end states of pieces 0 .. pieces-2
    (`ends` [N * (pieces - 1), H, P, N]) and the rows' initial states (`init` or None)."""
    lane_first, lane_count = lanes
    num_heads, num_chunks = acs.shape[:2]
    chunk_ids = jnp.arange(num_chunks, dtype=jnp.int32)
    lane = jnp.clip(searchsorted(jnp, lane_first, chunk_ids, side="right").astype(jnp.int32) - 1, 0, None)
    inside = chunk_ids < lane_first[lane] + lane_count[lane]  # empty lanes share lane_first with the next one
    totals = jax.ops.segment_sum(jnp.where(inside, acs[:, :, -1], 0.0).T, jnp.where(inside, lane, lane.shape[0]),
                                 num_segments=lane_first.shape[0])  # [L, H]: each lane's summed log decay
    decay = jnp.exp(totals).reshape(num_rows, pieces, num_heads, 1, 1)
    ends = ends.reshape(num_rows, pieces - 1, *ends.shape[1:])
    start = jnp.zeros_like(ends[:, 0]) if init is None else init
    starts = [start]
    for p in range(pieces - 1):
        start = decay[:, p] * start + ends[:, p]
        starts.append(start)
    return jnp.stack(starts, axis=1).reshape(num_rows * pieces, *ends.shape[2:])


@functools.partial(jax.jit, static_argnames=("dt_limit", "state_layout", "chunk_size", "interpret", "pieces", "stages"))
def ssd(x, dt, A, B, C, *, D=None, dt_bias=None, z=None, dt_limit=None, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="vk", chunk_size=64, interpret=False,
        pieces="auto", stages=None):
    """Chunked SSD scan of packed rows with final and checkpoint states on Mosaic GPU kernels.

    x                   # [T, H, P] bf16 or f16, P in (64, 128)
    dt                  # [T, H] raw: delta = softplus(dt + dt_bias), clamped to dt_limit = (lo, hi) when given
    A, dt_bias          # [H]
    B, C                # [T, G, N] x's dtype, N in (64, 128), G dividing H
    D                   # [H] or [H, P]; None = 0
    z                   # [T, H, P] x's dtype; gate: y * silu(z), in fp32 in the kernel before y is rounded
    initial_state       # [N_rows, H, P, N] ("vk") or [N_rows, H, N, P] ("kv"); None = zeros
    cu_seqlens          # i32[N_rows + 1]; None = one row over all T tokens (may be traced)
    checkpoint_cu       # i32[N_rows + 1] with checkpoint_offsets i32[M]; both None = no checkpoints
    Metadata values are trusted (callers run `jaxckpt.plan.conventions`). Tuning: pieces ("auto" or an int: the
    sequence split), stages (TMA ring depth). Call `supports` first for tile sizes, dtypes and the backend.

    Returns (y [T, H, P] in x.dtype, final_state fp32 [N_rows, H, P, N], checkpoint_states fp32 [M, H, P, N])
    (states [.., H, N, P] for "kv"). Padding tokens and padded checkpoint entries are zeros.
    """
    check_state_layout(state_layout)
    reason = supports(x, dt, B, C, z, chunk_size=chunk_size, interpret=interpret, cu_seqlens=cu_seqlens, pieces=pieces,
                      stages=stages)
    if reason is not None:
        raise ValueError(reason)
    (x, dt, A, B, C, D, dt_bias, z), dims = check_ssd_inputs(x, dt, A, B, C, D=D, dt_bias=dt_bias, z=z)
    num_tokens, num_heads, head_p, num_groups, head_n = dims
    cu, ccu, offsets = packed_metadata(cu_seqlens, checkpoint_cu, checkpoint_offsets, num_tokens)
    num_rows = cu.shape[0] - 1
    num_ckpt = offsets.shape[0]
    init = ssd_initial_state(initial_state, dims, num_rows, state_layout, _F32)
    tokens = x, B, C, z
    if num_tokens == 0 or interpret:
        # a chunk's TMA box may reach past the last token: the GPU fills those rows with zeros, the interpreter
        # would clamp the box's start, so it gets zero rows to read; no token at all keeps one zero row
        tokens = tuple(None if a is None else jnp.pad(a, [(0, CHUNK if interpret else 1)] + [(0, 0)] * (a.ndim - 1))
                       for a in tokens)
    lay = chunk_layout(cu, ccu, offsets, chunk_size=CHUNK, num_tokens=tokens[0].shape[0], xp=jnp)
    num_chunks = lay.chunk_len.shape[0]

    delta = ssd_delta(dt, dt_bias, dt_limit, _F32)  # [T, H]
    pos = jnp.arange(CHUNK, dtype=jnp.int32)
    token_ids = jnp.clip(lay.chunk_start[:, None] + pos, 0, max(num_tokens - 1, 0))  # i32[NC, C]
    in_chunk = (pos < lay.chunk_len[:, None])[None]  # bool[1, NC, C]
    if num_tokens:
        delta_c = jnp.where(in_chunk, delta.T[:, token_ids], 0.0)  # [H, NC, C], padding slots 0
    else:
        delta_c = jnp.zeros((num_heads, num_chunks, CHUNK), _F32)
    # padding slots select 0 (their delta = 0 times A = -inf would be NaN); the floor keeps A = -inf an exact reset
    dA = jnp.where(in_chunk, floor_log_decay(delta_c * A.astype(_F32)[:, None, None]), 0.0)
    acs = jnp.cumsum(dA, axis=-1)  # [H, NC, C] chunk-local

    checkpoints = None
    if num_ckpt:
        ck_start, ck_count = checkpoint_ranges(lay, num_chunks)
        checkpoints = (ck_start, ck_count, lay.checkpoint_pos)
    if pieces == "auto":
        pieces = choose_pieces(num_rows, num_heads, head_p, num_tokens)
    lanes = split_lanes(lay.row_first_chunk, lay.row_num_chunks, pieces=pieces)
    chunks = (lay.chunk_start, lay.chunk_len, acs, delta_c)
    lane_init = init
    if pieces > 1:
        head_lanes = tuple(a.reshape(num_rows, pieces)[:, :-1].reshape(-1) for a in lanes)
        _, ends, _ = ssd_lanes(*head_lanes, *chunks, *tokens[:2], None, interpret=interpret, stages=stages)
        lane_init = _piece_starts(lanes, acs, ends, init, num_rows, pieces)
    y, lane_end, checkpoint_states = ssd_lanes(*lanes, *chunks, *tokens[:3], lane_init, checkpoints, D, tokens[3],
                                               interpret=interpret, stages=stages)
    y = y[:num_tokens]  # D x and the gate applied in the kernel; tokens past the last row come back zero
    final_state = lane_end.reshape(num_rows, pieces, *lane_end.shape[1:])[:, -1]
    if checkpoint_states is None:
        checkpoint_states = jnp.zeros((0, num_heads, head_p, head_n), _F32)
    else:
        checkpoint_states = jnp.where(lay.checkpoint_valid[:, None, None, None], checkpoint_states, 0)
    if state_layout == "kv":
        final_state, checkpoint_states = final_state.swapaxes(-1, -2), checkpoint_states.swapaxes(-1, -2)
    return y, final_state, checkpoint_states
