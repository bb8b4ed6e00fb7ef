"""Mamba2's SSD on Pallas Mosaic GPU (Hopper: wgmma, TMA, warp specialization; `interpret=True` on CPU), exporting
checkpoint states from inside the one pass that computes the outputs. Written against jax 0.11.2 (`plgpu.kernel`,
Lane lowering semantics, `num_threads` / `thread_name`); check this module when jax moves.

The math (chunked form, in-chunk checkpoints) is in README.md. What makes SSD different from the delta rules: the
state recurrence per chunk, S <- exp(Acs_last) S + S_loc, has no product with S on it, so the chain from one
chunk's state to the next is one wgmma accumulate plus a scalar scale, and everything else (scores, outputs) is off
the chain. So one kernel walks a *lane* (a contiguous range of one row's chunks, from a start state), keeps the
state in registers and writes outputs, the final state and checkpoint states; nothing per chunk goes to memory
but y.

Per grid point (lane, head h, column block j of BP = 64 of P), one CTA of three warpgroups, carrying
S^T-free the mamba layout S [BP, N] fp32 in registers (WGMMA layout, N = d_state on the columns):
- memory (last warpgroup, registers lowered): a TMA ring (2 to 4 slots) of the chunk's x[:, cols] [C, BP],
  B [C, N], C [C, N] (group h // (H / G)) and its Acs and delta rows [C] fp32.
- state (warpgroup 0): with w_j = exp(Acs_last - Acs_j) delta_j,
      S <- exp(Acs_last) S + (x^T w) B                      (A = x^T w [BP, C] from registers, B = the B tile)
  x^T comes from a transposed load of the x tile; x^T w is split into 16-bit hi + lo (two wgmmas into one fp32
  accumulator), so the carried state only sees fp32 accumulation rounding (x and B are exact 16-bit inputs).
  Before issuing the update it publishes S rounded to 16 bits (S_hi) into one of two SMEM slots for the output
  warpgroup. Checkpoints: a chunk with ck_count[c] > 0 forms, for each of its checkpoints at chunk position r,
  exp(Acs_{r-1}) S + (x^T w_r) B with w_r,j = exp(Acs_{r-1} - Acs_j) delta_j for j < r, else 0 (r = 0: S itself),
  before the update, and stores it fp32 straight from registers. The carried S never depends on checkpoints.
- output (warpgroup 1): scores = C B^T (wgmma, both operands SMEM), P = scores * exp(Acs_i - Acs_j) delta_j for
  j <= i (masked before the exp), rounded to 16 bits; then y = exp(Acs_i) (C S_hi^T) + P x (two accumulators,
  issued together; P from registers), staged and TMA-stored into the chunk-major y [NC, C, H, P] (a TMA store
  cannot be masked by rows, so every chunk is written whole). Precision as mamba_ssm's and FLA's chunk scans: the
  output products take the state and P in 16 bits with fp32 accumulation.
Ring slots are refilled once both consumers have released them (`in_free`, two arrivals); published S slots are
reused once the output warpgroup has read them (`s_free`). All warpgroups meet at a final barrier (a warpgroup
exiting while another still issues wgmmas has faulted on sm_90 with jax 0.11.2) and every waiter observes every
phase of its barriers (the interpreter checks it).

Token layout. A TMA copy into a tiled SMEM tile must start on a whole (8, 64) tile of its GMEM array
(`jaxckpt.ops.common.pallas_mosaic_gpu_delta` docstring, "TMA addresses"), which chunk starts of varlen rows are
not. So x, B and C are gathered into chunk-major copies [NC, C, H, P] / [NC, C, G, N] (rows past a chunk's tokens
zero, by a select: NaN padding stays out) and y is gathered back; padding slots get delta = 0, so they neither
decay nor add input. When the rows are known on the host (cu_seqlens None or concrete) and every row length is a
multiple of C, chunk c is tokens [cC, (c + 1) C) and both copies are free reshapes ("aligned" layout).

Sequence split (`pieces`). A lane runs its chunks in order, so one row and few heads leave SMs idle ((1, 32768,
32) at P = 64: 32 CTAs on 132 SMs). As for the delta rules (`pallas_mosaic_gpu_split`), every row is cut into
`pieces` contiguous lanes. Here a piece's state map is S_end = m S_start + E with m = exp(sum of the piece's Acs_last)
a scalar per head, so: (1) a state-only pass (no output warpgroup, no C tile) gives E for pieces 0 .. pieces-2 from
zero states, (2) XLA scans start_{p+1} = m_p start_p + E_p (pieces - 1 elementwise steps, fp32; m_p from a
segment sum of the chunks' Acs_last), (3) the main pass runs all lanes from their starts. Exact up to fp32
rounding. `choose_pieces`: 1 when rows x heads x P / 64 already fill half the SMs, else the largest power of two
up to 8 whose main pass fits in one wave of CTAs, keeping >= 8 chunks per piece on average.

SMEM at N = 128, BP = 64, bf16: a ring slot holds x 8 KB + B 16 KB + C 16 KB + 512 B of rows (state-only pass:
24.5 KB), plus two published S_hi tiles (32 KB) and the y staging tile (8 KB): 4 slots fit in 227 KB.

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

from jaxckpt.ops.common import pallas_mosaic_gpu_tiles as tiles
from jaxckpt.ops.common import pallas_triton_delta as triton_delta
from jaxckpt.ops.common.pallas_mosaic_gpu_delta import _is_hopper
from jaxckpt.ops.common.pallas_mosaic_gpu_split import split_lanes
from jaxckpt.ops.common.xla_arrays import check_float, check_ssd_inputs, packed_metadata
from jaxckpt.plan.checks import check_dt_limit, check_ssd_state
from jaxckpt.plan.conventions import check_state_layout
from jaxckpt.plan.layout import chunk_layout, searchsorted

CHUNK = 64
BLOCK_P = 64
HEAD_DIMS = (64, 128)  # P (blocks of 64) and N (the registers of the carried [64, N] fp32 state)
DTYPES = (jnp.bfloat16, jnp.float16)
TUNING_KEYS = ("pieces", "stages")
MAX_PIECES = 8
MIN_CHUNKS_PER_PIECE = 8
DEFAULT_NUM_SMS = 132  # H200
_F32 = jnp.float32
_WG = plgpu.Layout.WGMMA
_ROW = _WG.reduce(1)
_COL = _WG.reduce(0)
_SMEM_BYTES = 227 * 1024
_PUBLISH = 2  # published S_hi slots
_STATE, _OUTPUT = 0, 1
# mamba_ssm's `_chunk_cumsum_fwd` returns dt itself above this threshold instead of softplus(dt).
_SOFTPLUS_THRESHOLD = 20.0


def supports(x, dt, B, C, z=None, *, chunk_size=64, interpret=False, **tuning) -> str | None:
    """None when this backend can run the call, else the reason (so the caller can fall back). An option given as
    None means its default."""
    tuning = {key: value for key, value in tuning.items() if value is not None}
    unknown = sorted(set(tuning) - set(TUNING_KEYS))
    if unknown:
        return f"tuning: unknown options {unknown}, expected some of {TUNING_KEYS}"
    pieces = tuning.get("pieces", "auto")
    if pieces != "auto" and not (isinstance(pieces, (int, np.integer)) and 1 <= pieces <= 64):
        return f"pieces: must be 'auto' or an int in [1, 64], got {pieces!r}"
    if tuning.get("stages") not in (None, 2, 3, 4):
        return f"stages: must be 2, 3 or 4, got {tuning['stages']!r}"
    if chunk_size != CHUNK:
        return f"chunk_size: the Mosaic GPU SSD runs {CHUNK}-token chunks (wgmma tiles), got {chunk_size!r}"
    if x.ndim != 3 or B.ndim != 3 or C.shape != B.shape:
        return "x, B, C: expected [T, H, P], [T, G, N], [T, G, N]"
    for name, size in (("P", x.shape[-1]), ("N", B.shape[-1])):
        if size not in HEAD_DIMS:
            return f"{name}: must be one of {HEAD_DIMS} for the wgmma tiles, got {size}"
    if x.dtype not in DTYPES or B.dtype != x.dtype or C.dtype != x.dtype:
        return (f"x, B, C: one 16-bit dtype (bfloat16 or float16) for the wgmma operands, got {x.dtype}, {B.dtype}, "
                f"{C.dtype} (float32 inputs: use pallas_triton or xla)")
    if dt.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return f"dt: dtype must be float32, bfloat16 or float16 on this backend, got {dt.dtype}"
    if not interpret and not _is_hopper():
        return "backend: the Mosaic GPU SSD needs a Hopper GPU (sm_90, wgmma) or interpret=True"
    return None


def _stages(head_n, dtype, *, has_output, stages=None):
    size = jnp.dtype(dtype).itemsize
    per_stage = CHUNK * (BLOCK_P + (2 if has_output else 1) * head_n) * size + 2 * 4 * CHUNK
    fixed = (_PUBLISH * BLOCK_P * head_n + CHUNK * BLOCK_P) * size if has_output else 0
    fixed += 1024  # barriers and alignment
    for depth in (4, 3, 2) if stages is None else (stages,):
        if depth * per_stage + fixed <= _SMEM_BYTES:
            return depth
    raise ValueError(f"stages: {stages or 2} TMA slots at N = {head_n} need {(stages or 2) * per_stage + fixed} "
                     f"bytes of SMEM, more than {_SMEM_BYTES}")


def _lhs(x, detour):
    """x (16-bit registers) as a wgmma A operand; under the interpreter (`detour` a scratch tile) through SMEM."""
    if detour is None:
        return x
    detour[...] = x
    plgpu.commit_smem()
    return detour


def _matmul(shape, pairs, during=None):
    """sum(a @ b for a, b in pairs) into an fp32 accumulator; `during()` runs between the issue and the read. The
    optimization barrier keeps arithmetic on the result after the accumulator read (its wait has no data
    dependency on the registers)."""
    def scoped(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)
        if during is not None:
            during()
        return acc[...]

    return lax.optimization_barrier(pl.run_scoped(scoped, plgpu.ACC(shape, _F32)))


def _ssd_kernel(*refs, reps, stages, has_output, has_init, has_checkpoints, **s):
    refs = list(refs)
    take = lambda count: [refs.pop(0) for _ in range(count)]  # noqa: E731
    first_ref, count_ref, acs_ref, delta_ref, x_ref, b_ref = take(6)
    c_ref = refs.pop(0) if has_output else None
    init_ref = refs.pop(0) if has_init else None
    ck_start_ref, ck_count_ref, ck_pos_ref = take(3) if has_checkpoints else (None, None, None)
    y_ref = refs.pop(0) if has_output else None
    end_ref = refs.pop(0)
    ckpt_ref = refs.pop(0) if has_checkpoints else None
    x_s, b_s, acs_s, delta_s, in_bar, in_free = (s["x_s"], s["b_s"], s["acs_s"], s["delta_s"], s["in_bar"],
                                                 s["in_free"])

    lane, h, j = lax.axis_index("l"), lax.axis_index("h"), lax.axis_index("j")
    wg = lax.axis_index("wg")
    g = lax.div(h, reps)
    head_n = b_s.shape[-1]
    dtype = x_s.dtype
    first, count = first_ref[lane], count_ref[lane]
    cols = pl.ds(j * BLOCK_P, BLOCK_P)
    state_shape = (BLOCK_P, head_n)
    memory_wg = 2 if has_output else 1
    detour = lambda name: s.get(name)  # noqa: E731  (interpret only)

    @pl.when(wg == memory_wg)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def refill(i, carry):
            c, slot = first + i, lax.rem(i, stages)

            @pl.when(i >= stages)
            def _():
                plgpu.barrier_wait(in_free.at[slot])  # the consumers are done with chunk i - stages

            bar = in_bar.at[slot]
            plgpu.copy_gmem_to_smem(x_ref.at[c, :, h, cols], x_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(b_ref.at[c, :, g], b_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(acs_ref.at[h, c], acs_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(delta_ref.at[h, c], delta_s.at[slot], bar)
            if has_output:
                plgpu.copy_gmem_to_smem(c_ref.at[c, :, g], s["c_s"].at[slot], bar)
            return carry

        lax.fori_loop(0, count, refill, 0)

        def drain(i, carry):
            plgpu.barrier_wait(in_free.at[lax.rem(i, stages)])
            return carry

        lax.fori_loop(jnp.maximum(count - stages, 0), count, drain, 0)

    @pl.when(wg == _STATE)
    def _state():
        plgpu.set_max_registers(232, action="increase")
        S0 = tiles.load(init_ref.at[lane, h, cols]) if has_init else plgpu.layout_cast(
            jnp.zeros(state_shape, _F32), _WG)
        tile_t = (BLOCK_P, CHUNK)  # x^T

        def checkpoints(c, slot, S, x_t, acs, delta):
            token = tiles.iota(tile_t, 1)

            def one(m, carry):
                r = ck_pos_ref[m]
                before = token < r
                acs_r = acs_s[slot, jnp.maximum(r - 1, 0)]
                decay = jnp.exp(jnp.where(r > 0, acs_r, 0.0))  # r = 0: no tokens, S itself
                weights = jnp.exp(jnp.where(before, acs_r - acs, -jnp.inf)) * delta
                hi, lo = tiles.split(x_t * weights, dtype, 2)
                pairs = ((_lhs(hi, detour("xw_hi_d")), b_s.at[slot]), (_lhs(lo, detour("xw_lo_d")), b_s.at[slot]))
                ckpt_ref.at[m, h, cols][...] = decay * S + _matmul(state_shape, pairs)
                return carry

            start = ck_start_ref[c]
            lax.fori_loop(start, start + ck_count_ref[c], one, 0)

        def step(i, S):
            c, slot, half = first + i, lax.rem(i, stages), lax.rem(i, _PUBLISH)
            plgpu.barrier_wait(in_bar.at[slot])
            acs = tiles.by_col(tiles.load(acs_s.at[slot], _COL), tile_t)
            acs_last = acs_s[slot, CHUNK - 1]  # padding slots have delta = 0: the last real token's
            delta = tiles.by_col(tiles.load(delta_s.at[slot], _COL), tile_t)
            x_t = tiles.load(x_s.at[slot].T).astype(_F32)  # [BP, C]
            if has_checkpoints:
                @pl.when(ck_count_ref[c] > 0)
                def _():
                    checkpoints(c, slot, S, x_t, acs, delta)

            weights = jnp.exp(acs_last - acs) * delta
            hi, lo = tiles.split(x_t * weights, dtype, 2)

            def publish():
                @pl.when(i >= _PUBLISH)
                def _():
                    plgpu.barrier_wait(s["s_free"].at[half])  # the output warpgroup read the slot's last S

                s["s_pub"].at[half][...] = S.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(s["s_ready"].at[half])

            pairs = ((_lhs(hi, detour("xw_hi_d")), b_s.at[slot]), (_lhs(lo, detour("xw_lo_d")), b_s.at[slot]))
            S_next = jnp.exp(acs_last) * S + _matmul(state_shape, pairs, publish if has_output else None)
            plgpu.barrier_arrive(in_free.at[slot])
            return S_next

        end_ref.at[lane, h, cols][...] = lax.fori_loop(0, count, step, S0)
        if has_output:
            def drain(i, carry):
                plgpu.barrier_wait(s["s_free"].at[lax.rem(i, _PUBLISH)])
                return carry

            lax.fori_loop(jnp.maximum(count - _PUBLISH, 0), count, drain, 0)

    if has_output:
        @pl.when(wg == _OUTPUT)
        def _output():
            plgpu.set_max_registers(232, action="increase")
            c_s, s_pub, y_s = s["c_s"], s["s_pub"], s["y_s"]
            square = (CHUNK, CHUNK)
            lower = tiles.iota(square, 0) >= tiles.iota(square, 1)

            def step(i, carry):
                c, slot, half = first + i, lax.rem(i, stages), lax.rem(i, _PUBLISH)
                plgpu.barrier_wait(in_bar.at[slot])
                scores = _matmul(square, ((c_s.at[slot], b_s.at[slot].T),))  # C B^T
                acs_i = tiles.load(acs_s.at[slot], _ROW)
                decay = jnp.exp(jnp.where(lower, tiles.by_row(acs_i, square)
                                          - tiles.by_col(tiles.load(acs_s.at[slot], _COL), square), -jnp.inf))
                p = (scores * decay * tiles.by_col(tiles.load(delta_s.at[slot], _COL), square)).astype(dtype)
                plgpu.barrier_wait(s["s_ready"].at[half])
                inter, intra = tiles.dots(((c_s.at[slot],), (s_pub.at[half].T,), (CHUNK, BLOCK_P)),
                                          ((_lhs(p, detour("p_d")),), (x_s.at[slot],), (CHUNK, BLOCK_P)))
                plgpu.barrier_arrive(s["s_free"].at[half])
                plgpu.barrier_arrive(in_free.at[slot])
                y = tiles.by_row(jnp.exp(acs_i), (CHUNK, BLOCK_P)) * inter + intra
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's store has read y_s
                y_s[...] = y.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(y_s, y_ref.at[c, :, h, cols])
                return carry

            lax.fori_loop(0, count, step, 0)
            plgpu.wait_smem_to_gmem(0)

    plgpu.barrier_arrive(s["done"])
    plgpu.barrier_wait(s["done"])


def ssd_lanes(lane_first, lane_count, acs, delta, x, B, C, lane_init=None, checkpoints=None, *, interpret=False,
              stages=None):
    """The SSD scan over L lanes (module docstring), all arrays chunk-major.

    lane_first, lane_count  # i32[L]: lane l walks chunks lane_first[l] .. + lane_count[l] - 1 (lanes never share one)
    acs, delta              # fp32 [H, NC, C]: chunk-local inclusive cumsum of delta * A, and delta (padding 0)
    x                       # [NC, C, H, P] 16-bit, rows past a chunk's tokens zero
    B, C                    # [NC, C, G, N] same dtype; C None: the state-only pass (no outputs)
    lane_init               # fp32 [L, H, P, N] start states, or None (zeros)
    checkpoints             # (ck_start i32[NC], ck_count i32[NC], checkpoint_pos i32[M]) or None
    Returns (y chunk-major [NC, C, H, P] (chunks outside every lane unspecified; None without C), lane_end fp32
    [L, H, P, N], checkpoint_states fp32 [M, H, P, N] or None).
    """
    num_chunks, chunk, num_heads, head_p = x.shape
    num_groups, head_n = B.shape[2:]
    if chunk != CHUNK or head_p % BLOCK_P or head_n not in HEAD_DIMS:
        raise ValueError(f"x, B: expected {CHUNK}-row chunks, P a multiple of {BLOCK_P}, N in {HEAD_DIMS}, got "
                         f"{x.shape}, {B.shape}")
    has_output = C is not None
    has_init = lane_init is not None
    has_checkpoints = checkpoints is not None and checkpoints[2].shape[0] > 0
    dtype = x.dtype
    num_lanes = lane_first.shape[0]
    stages = _stages(head_n, dtype, has_output=has_output, stages=stages)

    inputs = [lane_first.astype(jnp.int32), lane_count.astype(jnp.int32), acs.astype(_F32), delta.astype(_F32), x, B]
    inputs += [C] if has_output else []
    inputs += [lane_init.astype(_F32)] if has_init else []
    inputs += [a.astype(jnp.int32) for a in checkpoints] if has_checkpoints else []
    state_type = lambda rows: jax.ShapeDtypeStruct((rows, num_heads, head_p, head_n), _F32)  # noqa: E731
    out_type = ([jax.ShapeDtypeStruct(x.shape, dtype)] if has_output else []) + [state_type(num_lanes)]
    out_type += [state_type(checkpoints[2].shape[0])] if has_checkpoints else []
    consumers = 2 if has_output else 1
    scratch = dict(
        x_s=tiles.swizzled((stages, CHUNK, BLOCK_P), dtype), b_s=tiles.swizzled((stages, CHUNK, head_n), dtype),
        acs_s=plgpu.SMEM((stages, CHUNK), _F32), delta_s=plgpu.SMEM((stages, CHUNK), _F32),
        in_bar=plgpu.Barrier(num_arrivals=5 if has_output else 4, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),
        done=plgpu.Barrier(num_arrivals=consumers + 1))
    if has_output:
        scratch.update(c_s=tiles.swizzled((stages, CHUNK, head_n), dtype),
                       s_pub=tiles.swizzled((_PUBLISH, BLOCK_P, head_n), dtype), y_s=tiles.swizzled((CHUNK, BLOCK_P), dtype),
                       s_ready=plgpu.Barrier(num_barriers=_PUBLISH), s_free=plgpu.Barrier(num_barriers=_PUBLISH))
    if interpret:
        scratch.update(xw_hi_d=tiles.swizzled((BLOCK_P, CHUNK), dtype), xw_lo_d=tiles.swizzled((BLOCK_P, CHUNK), dtype))
        if has_output:
            scratch.update(p_d=tiles.swizzled((CHUNK, CHUNK), dtype))
    body = functools.partial(_ssd_kernel, reps=num_heads // num_groups, stages=stages, has_output=has_output,
                             has_init=has_init, has_checkpoints=has_checkpoints)
    kernel = plgpu.kernel(
        body, out_type=tuple(out_type), scratch_types=scratch, grid=(num_lanes, num_heads, head_p // BLOCK_P),
        grid_names=("l", "h", "j"), num_threads=consumers + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=tiles.interpret_params(interpret), kernel_name="ssd_lanes" if has_output else "ssd_lanes_states")
    outs = list(kernel(*inputs))
    y = outs.pop(0) if has_output else None
    lane_end = outs.pop(0)
    return y, lane_end, (outs.pop(0) if has_checkpoints else None)


def _device_sms() -> int:
    device = jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else DEFAULT_NUM_SMS


def choose_pieces(num_rows, num_heads, head_p, num_tokens, *, num_sms=None) -> int:
    """Pieces per row (module docstring, "Sequence split"): static, from shapes only."""
    num_sms = num_sms or _device_sms()
    plain = num_rows * num_heads * (head_p // BLOCK_P)
    if num_rows == 0 or 2 * plain > num_sms:
        return 1
    chunks = num_tokens / num_rows / CHUNK
    pieces = 1
    while 2 * pieces <= MAX_PIECES and plain * 2 * pieces <= num_sms and chunks / (2 * pieces) >= MIN_CHUNKS_PER_PIECE:
        pieces *= 2
    return pieces


def _aligned_rows(cu_seqlens, num_tokens) -> bool:
    """Whether every row is known on the host to start and end on the C-token grid (module docstring)."""
    if num_tokens % CHUNK or num_tokens == 0:
        return False
    if cu_seqlens is None:
        return True
    if isinstance(cu_seqlens, jax.core.Tracer):
        return False
    cu = np.asarray(cu_seqlens)
    return bool(np.all(cu % CHUNK == 0)) and int(cu[-1]) == num_tokens


def _softplus(v):
    return jnp.where(v > _SOFTPLUS_THRESHOLD, v, jnp.log1p(jnp.exp(jnp.minimum(v, _SOFTPLUS_THRESHOLD))))


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


def ssd(x, dt, A, B, C, *, D=None, dt_bias=None, z=None, dt_limit=None, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="vk", chunk_size=64, interpret=False,
        pieces="auto", stages=None):
    """Chunked SSD scan of packed rows with final and checkpoint states on Mosaic GPU kernels.

    x                   # [T, H, P] bf16 or f16, P in (64, 128)
    dt                  # [T, H] raw: delta = softplus(dt + dt_bias), clamped to dt_limit = (lo, hi) when given
    A, dt_bias          # [H]
    B, C                # [T, G, N] x's dtype, N in (64, 128), G dividing H
    D                   # [H] or [H, P]; None = 0
    z                   # [T, H, P] gate: y * silu(z)
    initial_state       # [N_rows, H, P, N] ("vk") or [N_rows, H, N, P] ("kv"); None = zeros
    cu_seqlens          # i32[N_rows + 1]; None = one row over all T tokens (may be traced)
    checkpoint_cu       # i32[N_rows + 1] with checkpoint_offsets i32[M]; both None = no checkpoints
    Metadata values are trusted (callers run `jaxckpt.plan.conventions`). Tuning: pieces ("auto" or an int: the
    sequence split), stages (TMA ring depth). Call `supports` first for tile sizes, dtypes and the backend.

    Returns (y [T, H, P] in x.dtype, final_state fp32 [N_rows, H, P, N], checkpoint_states fp32 [M, H, P, N])
    (states [.., H, N, P] for "kv"). Padding tokens and padded checkpoint entries are zeros.
    """
    check_state_layout(state_layout)
    reason = supports(x, dt, B, C, z, chunk_size=chunk_size, interpret=interpret, pieces=pieces, stages=stages)
    if reason is not None:
        raise ValueError(reason)
    aligned = _aligned_rows(cu_seqlens, x.shape[0])
    (x, dt, A, B, C, D, dt_bias, z), dims = check_ssd_inputs(x, dt, A, B, C, D=D, dt_bias=dt_bias, z=z)
    num_tokens, num_heads, head_p, num_groups, head_n = dims
    limit = check_dt_limit(dt_limit)
    cu, ccu, offsets = packed_metadata(cu_seqlens, checkpoint_cu, checkpoint_offsets, num_tokens)
    num_rows = cu.shape[0] - 1
    num_ckpt = offsets.shape[0]
    init = None
    if initial_state is not None:
        init = check_float(initial_state, name="initial_state").astype(_F32)
        check_ssd_state(init, dims, num_rows, state_layout)
        init = init.swapaxes(-1, -2) if state_layout == "kv" else init
    if num_tokens == 0:
        # one zero token keeps every gather in range; no lane walks a chunk
        x, B, C = (jnp.zeros((1, *a.shape[1:]), a.dtype) for a in (x, B, C))
        dt = jnp.zeros((1, num_heads), dt.dtype)
    padded_tokens = x.shape[0]
    lay = chunk_layout(cu, ccu, offsets, chunk_size=CHUNK, num_tokens=padded_tokens, xp=jnp)
    num_chunks = padded_tokens // CHUNK if aligned else lay.chunk_len.shape[0]

    raw = dt.astype(_F32) if dt_bias is None else dt.astype(_F32) + dt_bias.astype(_F32)
    delta = _softplus(raw)  # [T, H]
    if limit is not None:
        delta = jnp.clip(delta, *limit)
    pos = jnp.arange(CHUNK, dtype=jnp.int32)
    if aligned:
        chunked = lambda a: a.reshape(num_chunks, CHUNK, *a.shape[1:])  # noqa: E731
        delta_c = chunked(delta).transpose(2, 0, 1)  # [H, NC, C]
    else:
        tokens = jnp.clip(lay.chunk_start[:, None] + pos, 0, padded_tokens - 1)  # i32[NC, C]
        in_chunk = pos < lay.chunk_len[:, None]  # bool[NC, C]

        def chunked(a):
            return jnp.where(in_chunk.reshape(*in_chunk.shape, *(1,) * (a.ndim - 1)), a[tokens], jnp.zeros((), a.dtype))

        delta_c = chunked(delta).transpose(2, 0, 1)
    acs = jnp.cumsum(delta_c * A.astype(_F32)[:, None, None], axis=-1)  # [H, NC, C] chunk-local
    x_c, B_c, C_c = chunked(x), chunked(B), chunked(C)

    checkpoints = None
    if num_ckpt:
        ck_start, ck_count = triton_delta._checkpoint_ranges(lay, num_chunks)
        checkpoints = (ck_start, ck_count, lay.checkpoint_pos)
    if pieces == "auto":
        pieces = choose_pieces(num_rows, num_heads, head_p, num_tokens)
    lanes = split_lanes(lay.row_first_chunk, lay.row_num_chunks, pieces=pieces)
    lane_init = init
    if pieces > 1:
        head_lanes = tuple(a.reshape(num_rows, pieces)[:, :-1].reshape(-1) for a in lanes)
        _, ends, _ = ssd_lanes(*head_lanes, acs, delta_c, x_c, B_c, None, interpret=interpret, stages=stages)
        lane_init = _piece_starts(lanes, acs, ends, init, num_rows, pieces)
    y_c, lane_end, checkpoint_states = ssd_lanes(*lanes, acs, delta_c, x_c, B_c, C_c, lane_init, checkpoints,
                                                 interpret=interpret, stages=stages)
    final_state = lane_end.reshape(num_rows, pieces, *lane_end.shape[1:])[:, -1]
    if checkpoint_states is None:
        checkpoint_states = jnp.zeros((0, num_heads, head_p, head_n), _F32)
    else:
        checkpoint_states = jnp.where(lay.checkpoint_valid[:, None, None, None], checkpoint_states, 0)

    if aligned:  # every token in a row: no gather, no mask, and no pass at all without D and z
        y = y_c.reshape(padded_tokens, num_heads, head_p)
    else:
        slot = lay.token_chunk * CHUNK + lay.token_pos
        # tokens past cu_seqlens[-1] belong to no row: zeros rather than garbage
        y = jnp.where(lay.token_valid[:, None, None], y_c.reshape(-1, num_heads, head_p)[slot], 0)[:num_tokens]
    if D is not None or z is not None:
        out = y.astype(_F32)
        if D is not None:
            out = out + D.astype(_F32).reshape(num_heads, -1) * x[:num_tokens].astype(_F32)
        if z is not None:
            zf = z.astype(_F32)
            out = out * zf * jax.nn.sigmoid(zf)
        y = jnp.where(lay.token_valid[:num_tokens, None, None], out, 0).astype(x.dtype)
    if state_layout == "kv":
        final_state, checkpoint_states = final_state.swapaxes(-1, -2), checkpoint_states.swapaxes(-1, -2)
    return y, final_state, checkpoint_states
