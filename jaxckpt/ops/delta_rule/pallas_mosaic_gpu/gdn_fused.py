"""A fused GDN (scalar decay) chunked pass on Pallas Mosaic GPU: one small kernel for the gate-free inverse, then one
warp-specialized state loop that forms everything else per chunk, so that W, U, KD, QG and AQK are never written.

Written against jax 0.11.2 (`plgpu.kernel`, Lane lowering semantics, `num_threads` / `thread_name` warp
specialization); check this module when jax moves.

Why: the unfused Mosaic GPU GDN pipeline (`intra.gdn_intra` then a state pass) writes five
chunk-major intermediates (~150 MB at T 8192, 16 heads, K = V = 128, bf16) and re-reads them per 64-column V block.
For a scalar decay per token the decayed inverse is a diagonal similarity of the gate-free one: with
D = diag(exp(G)) (G the chunk-local inclusive cumulative log decay), A = D A0 D^-1 where A0 = strict_lower(beta_i
k_i . k_j), so (I + A)^-1 = D T0 D^-1 with T0 = (I + A0)^-1, i.e. T[i, j] = T0[i, j] exp(G_i - G_j). Then, per chunk
with S fp32 [K, V] (`jaxckpt/ops/delta_rule/README.md`; this is version 2's W = T beta exp(G) K, U = T beta V with T
expanded):
    Ag = T0 * exp(G_i - G_j) * beta_j (i >= j)          v_new = Ag (v - exp(G) * (k S))
    O = scale * (exp(G) * (q S) + (tril(q k^T) * exp(G_i - G_j)) v_new)
    S <- exp(G_last) S + k^T (exp(G_last - G) * v_new)
Every exponent is <= 0 on real rows (G is non-increasing in the chunk; padding rows carry G_last, giving 0).

Kernels:
1. `gdn_kkt`, grid (chunk, value head), one warpgroup: lands the chunk's q, k, v rows from the token layout
   ([T, H, K] at a chunk start that follows cu_seqlens) untiled into 128-byte-swizzled pieces, masks rows past the
   chunk's length to zero in registers (a select: NaN padding stays out), forms k k^T with a wgmma and T0 by
   `intra`'s recursive doubling (fp16 operands: the "f16" inverse, whose accuracy and range,
   fine for l2-normalized keys and beta <= 1, are in that module's docstring; `inverse="blocked"`: that module's
   "blocked" inverse, T0's 16 x 16 diagonal blocks by fp32 forward substitution and then the fp16 levels s = 16, 32
   only, 4 dependent products instead of 10, its 18 KB pad tile aliased with the doubling's operand tiles; not yet
   measured, so "f16" stays the default), and writes T0 [HV, NC, C, C] in the
   16-bit I/O dtype plus *chunk-major copies* of q, k ([H, NC, C, K], written by the CTA of each key head's first
   value head) and v ([HV, NC, C, V]), rows past the chunk zero. Why copies: the state loop needs q, k, v as tiled
   wgmma operands, and a TMA copy into a tiled SMEM tile must start on an 8-row tile of its GMEM array
   (`pipeline` docstring, "TMA addresses"), which token-layout chunk starts are not. Re-tiling in
   the state loop's SMEM instead would need landing tiles next to the operand ring (~40 KB more per slot at
   K = 128, beyond 227 KB with 2 slots) and register passes on the output warpgroup. Cost of the copies, at
   (1, 8192, 16), K = V = 128, bf16 (q, k, v 33.5 MB each, T0 16.8 MB): `gdn_kkt` reads q, k, v (100 MB) and
   writes the copies and T0 (117 MB); the state loop reads those back per 64-column V block (2 blocks, the second
   mostly from L2, both walking the same chunks). The unfused pipeline reads the same 100 MB, writes W, U, KD, QG,
   AQK (151 MB) and re-reads them per V block. The copies also carry zeroed padding rows, which the state update
   needs (its k^T v_new product would turn 0 * NaN into NaN).
2. `gdn_fused_lanes`, grid (lane, value head, column block j of BV = 64 columns of S), three warpgroups
   (`state`'s lanes contract: a lane is a contiguous range of chunks with a start state):
   - memory (warpgroup 2, registers lowered): a 2- to 4-slot TMA ring of the chunk tiles q, k, v[:, cols], T0 and
     the G and beta rows; a slot is refilled once both consumers have released it (`in_free`, two arrivals).
   - state (warpgroup 0): carries S^T [BV, K] fp32 in registers (WGMMA layout) so every product on the chain takes
     its A operand from registers: (k S)^T = S^T k^T (S^T as hi + lo, two wgmmas), X^T = v^T - exp(G) (k S)^T,
     v_new^T = beta X^T + X^T Ag_<^T (X^T hi + lo, Ag_< the strictly lower part of Ag, in SMEM),
     S^T <- exp(G_last) S^T + (v_new^T exp(G_last - G)) k (hi + lo). It publishes S^T_hi during the first wgmma and
     v_new_hi during the update, for the output warpgroup.
     Precision: as the current pass (`pipeline` docstring) the state-feeding operands (S, X, and
     v_new in its decayed form) are 16-bit hi + lo pairs with fp32 accumulation. Ag is one 16-bit term, but its
     diagonal (beta_i: T0's diagonal is 1) is applied in fp32 registers, because rounding it dominates otherwise.
     Measured offline (numpy, K = V = 128, 128 chunks, unit bf16 keys, beta = sigmoid(N(0, 1)),
     g = -softplus(-N(0, 1)), start state 0.1 N(0, 1)), final-state rel-RMS against exact arithmetic: Ag rounded
     to bf16 whole 0.8-2.3e-3 (T0 bf16 or fp16 alike), diagonal in fp32 and Ag_< in bf16 1.4e-5-6.9e-5, T0 in bf16
     with Ag exact 4e-5 (so T0 stays one 16-bit term); the unfused pipeline's bf16 W, U 1.9-2.4e-3. Dropping
     X_lo measured the same there (1.3e-5: Ag_< is small for uncorrelated keys) but is kept for correlated ones.
     `state_terms=1` drops every lo half on the chain (S, X, the decayed v_new): one wgmma per product, as FLA's
     and jla's kernels round the state and v_new to 16 bits; a shorter chain for states at their error class.
   - output (warpgroup 1): one chunk ahead of the state warpgroup it turns the ring's T0 into Ag in place (so Ag
     is off the state chain), then for the current chunk forms the scores P = scale tril(q k^T) exp(G_i - G_j),
     waits for the published S^T_hi and v_new_hi and computes O = scale exp(G) (q S_hi) + P v_new_hi (two
     accumulators, issued together), staged and TMA-stored straight into the token layout o [T, HV, V] at the
     chunk's own tokens, as `state` does (its docstring, "O": a whole chunk as one box through
     the untiled view of `tiles.token_staging`, a row's partial last chunk as 32, ..., 1-row boxes from its plain
     view, zeros over the padding tokens from one extra, empty lane), so no XLA gather follows.
   Checkpoints as in `state`: a chunk with checkpoints forms, for each at chunk position r,
   exp(G_{r-1}) S + sum_{i<r} exp(G_{r-1} - G_i) k_i v_new_i^T (r = 0: S itself) in the state warpgroup after the
   update wgmma, with kr = k exp(G_{r-1} - G) (rows >= r masked by a select) split hi + lo into SMEM; the keys are
   the ring's k tile (already chunk-major and zero-padded, so no gathered key copy as there). The carried S never
   depends on checkpoints. States cross global memory transposed ([.., V, K]) as in `state`.
   map_mode: the lane's affine map [M | E] as the same recurrence over the column blocks of [I | 0] with v -> [0 | v];
   no q, no O (the output warpgroup only prepares Ag).
3. `gdn_fused_pass`: `gdn_kkt` + `gdn_fused_lanes` over whole rows, with `state.state_pass_v2`'s
   return contract (o in token order, padding tokens zero).

SMEM (K = V = 128, bf16): a ring slot holds q, k (16 KB each), v's column block and T0 / Ag (8 KB each) and the G,
beta rows: 48.5 KB; fixed: published S^T_hi 2 x 16 KB, v_new_hi 2 x 8 KB, P 8 KB, O staging 8 KB (three views of one
tile); checkpoint kr tiles 2 x 16 KB. 3 slots without checkpoints (210 KB), 2 with (194 KB); map_mode and K = 64 take
4 (`_stages`).

Interpret mode (`interpret=True` or a `plgpu.InterpretGPUParams`): Mosaic GPU's interpreter reads a wgmma's A
operand only from SMEM, so there every register operand takes a detour through a scratch tile (`tiles.lhs`); its wgmma
is an fp32 matmul of the 16-bit tiles, so the interpreter checks the algorithm, not the tensor-core rounding.
Supported: chunk 64, K and V in {64, 128}, q, k, v one 16-bit dtype, G and beta fp32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxckpt.ops.common import device
from jaxckpt.ops.common import pallas_mosaic_gpu_tiles as tiles
from jaxckpt.ops.common.checkpoint_chunks import checkpoint_ranges
from jaxckpt.ops.delta_rule import cumsum
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import intra as mosaic_intra

CHUNK = 64
BLOCK_V = 64
_F32 = jnp.float32
_WG = plgpu.Layout.WGMMA
_ROW = _WG.reduce(1)  # one value per row of a WGMMA-layout tile
_COL = _WG.reduce(0)  # one value per column
_STATE, _OUTPUT, _MEMORY = 0, 1, 2  # warpgroup ids


class Checkpoints(NamedTuple):
    """Where the lanes export checkpoint states (`checkpoint_chunks.checkpoint_ranges`, `chunk_layout`)."""

    ck_start: object        # i32[NC] per chunk, the CSR range [ck_start, ck_start + ck_count) of its checkpoints
    ck_count: object        # i32[NC]
    checkpoint_pos: object  # i32[M] position r in [0, C) inside its chunk: the state after the chunk's first r tokens


def supports(q, k, v, beta, *, interpret=False) -> str | None:
    """None when `gdn_fused_pass` can run on `prepare`'s q [T, H, K], k, v [T, HV, V], beta [T, HV], else the
    reason (so the caller can fall back to the unfused pipeline)."""
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or beta.shape != v.shape[:2]:
        return "q, k, v, beta: expected [T, H, K], [T, H, K], [T, HV, V], [T, HV]"
    if v.shape[1] % q.shape[1]:
        return f"v: value heads ({v.shape[1]}) must be a multiple of key heads ({q.shape[1]})"
    return (tiles.wgmma_reason(dict(K=q.shape[-1], V=v.shape[-1]), dict(q=q, k=k, v=v))
            or (None if interpret else device.hopper_reason()))


def _decayed_lower(G_row, G_col, shape):
    """exp(G_i - G_j) on i >= j, else 0 (masked to -inf before exp: exponents stay <= 0)."""
    lower = tiles.iota(shape, 0) >= tiles.iota(shape, 1)
    return jnp.exp(jnp.where(lower, tiles.by_row(G_row, shape) - tiles.by_col(G_col, shape), -jnp.inf))


# ----------------------------------------------------------------------------------------------------- gdn_kkt


def _kkt_kernel(start_ref, len_ref, q_ref, k_ref, v_ref, beta_ref, t0_ref, qc_ref, kc_ref, vc_ref, land_q, land_k,
                land_v, k_s, inv_bufs, t_out, b_row_s, bar, *, group, substitute):
    # inv_bufs: ((t_buf, p_buf), [] or [pad]), aliased (the pad is dead before the doubling writes its operands)
    (t_buf, p_buf), pad = inv_bufs
    c, h = lax.axis_index("c"), lax.axis_index("h")
    hk = lax.div(h, group)
    start, length = start_ref[c], len_ref[c]
    rows = pl.ds(start, CHUNK)
    tiles.land(q_ref.at[rows, hk], land_q, bar)
    tiles.land(k_ref.at[rows, hk], land_k, bar)
    tiles.land(v_ref.at[rows, h], land_v, bar)
    plgpu.copy_gmem_to_smem(beta_ref.at[h, c], b_row_s, bar)
    plgpu.barrier_wait(bar)

    k = tiles.landed_tokens(land_k, length)  # [C, K] fp32, rows past the chunk zero
    k_s.at[0][...] = k.astype(k_s.dtype)
    plgpu.commit_smem()
    sq = (CHUNK, CHUNK)
    (kk,) = tiles.dots(((k_s.at[0],), (k_s.at[0].T,), sq))
    # the masked copies leave through their own landing tiles while the inverse runs
    tiles.store_in_place(land_v, tiles.landed_tokens(land_v, length), vc_ref.at[h, c])

    @pl.when(lax.rem(h, group) == 0)  # one CTA per key head writes its q, k copies
    def _():
        q = tiles.landed_tokens(land_q, length)
        tiles.store_in_place(land_q, q, qc_ref.at[hk, c])
        tiles.store_in_place(land_k, k, kc_ref.at[hk, c])

    b_row = plgpu.load(b_row_s, layout=_ROW)
    A = jnp.where(tiles.iota(sq, 0) > tiles.iota(sq, 1), tiles.by_row(b_row, sq) * kk, 0.0)
    (t_term,) = mosaic_intra.doubling_inverse(A, t_buf, p_buf, t_out, pad=pad[0] if substitute else None)
    plgpu.copy_smem_to_gmem(t_term, t0_ref.at[h, c])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


KKT_INVERSES = ("f16", "blocked")


def gdn_kkt(chunk_start, chunk_len, q, k, v, beta, *, group, interpret=False, inverse="f16"):
    """The gate-free inverse T0 = (I + strict_lower(beta_i k_i . k_j))^-1 of every chunk and chunk-major, zero-padded
    copies of q, k, v (module docstring, kernel 1). `inverse`: "f16" (the recursive doubling) or "blocked" (the
    substitution for T0's 16 x 16 diagonal blocks, then two doubling levels; under `interpret` it doubles from s = 2,
    as `intra`'s "blocked" does).

    chunk_start, chunk_len  # i32[NC] (`chunk_layout`: a row's chunks restart at its start)
    q, k                    # [T, H, K] 16-bit
    v                       # [T, HV, V] same dtype
    beta                    # [T, HV]
    Returns (t0 [HV, NC, C, C] in the I/O dtype (padding rows and columns of the identity), q_c, k_c [H, NC, C, K],
    v_c [HV, NC, C, V] (rows past each chunk zero), beta_c fp32 [HV, NC, C] (padding rows zero)).
    """
    num_heads, head_k = q.shape[1:]
    num_v_heads, head_v = v.shape[1:]
    dtype = q.dtype
    if dtype not in tiles.DTYPES or k.dtype != dtype or v.dtype != dtype:
        raise ValueError(f"q, k, v: one 16-bit dtype (bfloat16 or float16), got {q.dtype}, {k.dtype}, {v.dtype}")
    if num_v_heads != group * num_heads:
        raise ValueError(f"group: expected HV // H = {num_v_heads // num_heads}, got {group}")
    if inverse not in KKT_INVERSES:
        raise ValueError(f"inverse: must be one of {KKT_INVERSES}, got {inverse!r}")
    num_chunks = chunk_start.shape[0]
    beta_c = tiles.chunk_major_beta(chunk_start, chunk_len, beta, chunk=CHUNK)
    width = 128 // dtype.itemsize  # 128-byte column pieces, swizzled as TMA writes them (no tiling: unaligned starts)
    landing = [plgpu.SMEM((d // width, CHUNK, width), dtype, transforms=(plgpu.SwizzleTransform(128),))
               for d in (head_k, head_k, head_v)]
    boxes = (2 * head_k + head_v) // width
    inv_buf = lambda: tiles.swizzled((1, CHUNK, CHUNK), jnp.float16)  # noqa: E731
    pad = [tiles.substitution_pad()] if inverse == "blocked" else []
    chunk_major = lambda heads, cols: jax.ShapeDtypeStruct((heads, num_chunks, CHUNK, cols), dtype)  # noqa: E731
    kernel = plgpu.kernel(
        functools.partial(_kkt_kernel, group=group, substitute=inverse == "blocked" and not interpret),
        out_type=(chunk_major(num_v_heads, CHUNK), chunk_major(num_heads, head_k), chunk_major(num_heads, head_k),
                  chunk_major(num_v_heads, head_v)),
        scratch_types=[*landing, tiles.swizzled((1, CHUNK, head_k), dtype),
                       plgpu.RefUnion([inv_buf(), inv_buf()], pad),
                       tiles.swizzled((1, CHUNK, CHUNK), dtype), plgpu.SMEM((CHUNK,), _F32),
                       plgpu.Barrier(num_arrivals=boxes + 1)],
        grid=(num_chunks, num_v_heads), grid_names=("c", "h"), interpret=tiles.interpret_params(interpret),
        kernel_name="gdn_kkt_mosaic_gpu")
    t0, q_c, k_c, v_c = kernel(chunk_start, chunk_len, q, k, v, beta_c)
    return t0, q_c, k_c, v_c, beta_c


# --------------------------------------------------------------------------------------------- gdn_fused_lanes


def _stages(head_k, dtype, *, map_mode, has_checkpoints):
    """The deepest TMA ring (2 to 4 slots) that fits next to the fixed tiles."""
    size = jnp.dtype(dtype).itemsize
    per_stage = CHUNK * ((1 if map_mode else 2) * head_k + BLOCK_V + CHUNK) * size + 2 * 4 * CHUNK
    # published S^T_hi and v_new_hi, P, O staging
    fixed = 0 if map_mode else (2 * BLOCK_V * head_k + 2 * CHUNK * BLOCK_V + CHUNK * CHUNK + CHUNK * BLOCK_V) * size
    fixed += 2 * CHUNK * head_k * size if has_checkpoints else 0
    fixed += 2048  # barriers and alignment
    return tiles.ring_depth(per_stage, fixed, what=f"of gdn_fused_lanes at K = {head_k}")


def _fused_kernel(*refs, group, scale, stages, map_mode, has_init, has_checkpoints, terms, interpret, pad_lane, **s):
    refs = list(refs)
    take = lambda count: [refs.pop(0) for _ in range(count)]  # noqa: E731
    first_ref, count_ref, G_ref, beta_ref, t0_ref, k_ref, v_ref = take(7)
    q_ref, start_ref, len_ref, pad_ref = (None,) * 4 if map_mode else take(4)
    init_ref = refs.pop(0) if has_init else None
    if has_checkpoints:
        ck_start_ref, ck_count_ref, ck_pos_ref = take(3)
    o_ref = None if map_mode else refs.pop(0)
    end_ref = refs.pop(0)
    ckpt_ref = None if map_mode else refs.pop(0)
    k_s, v_s, ag_s, G_s, b_s = s["k_s"], s["v_s"], s["ag_s"], s["G_s"], s["b_s"]
    in_bar, in_free, ag_ready, done = s["in_bar"], s["in_free"], s["ag_ready"], s["done"]

    lane, h, j = lax.axis_index("l"), lax.axis_index("h"), lax.axis_index("j")
    wg = lax.axis_index("wg")
    hk = lax.div(h, group)
    head_k = k_s.shape[-1]
    dtype = k_s.dtype
    first, count = first_ref[lane], count_ref[lane]
    state_shape = (BLOCK_V, head_k)  # S^T block
    sq = (CHUNK, CHUNK)
    if map_mode:
        key_blocks = head_k // BLOCK_V
        identity = j < key_blocks  # a column block of [I | 0]: v = 0, start = the identity's columns
        v_cols = pl.ds(jnp.maximum(j - key_blocks, 0) * BLOCK_V, BLOCK_V)
    else:
        v_cols = pl.ds(j * BLOCK_V, BLOCK_V)
    cols = pl.ds(j * BLOCK_V, BLOCK_V)

    @pl.when(wg == _MEMORY)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def issue(c, slot):
            bar = in_bar.at[slot]
            plgpu.copy_gmem_to_smem(k_ref.at[hk, c], k_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(v_ref.at[h, c, :, v_cols], v_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(t0_ref.at[h, c], ag_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(G_ref.at[h, c], G_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(beta_ref.at[h, c], b_s.at[slot], bar)
            if not map_mode:
                plgpu.copy_gmem_to_smem(q_ref.at[hk, c], s["q_s"].at[slot], bar)

        tiles.fill_ring(first, count, stages, in_free, issue)

    @pl.when(wg == _STATE)
    def _state():
        plgpu.set_max_registers(232, action="increase")
        if map_mode:
            rows = plgpu.broadcasted_iota(jnp.int32, state_shape, 0, layout=_WG)
            keys = plgpu.broadcasted_iota(jnp.int32, state_shape, 1, layout=_WG)
            S0 = jnp.where(identity & (keys == rows + j * BLOCK_V), 1.0, 0.0).astype(_F32)
        elif has_init:
            S0 = tiles.load(init_ref.at[tiles.lane_state(lane, pad_lane), h, cols])
        else:
            S0 = plgpu.layout_cast(jnp.zeros(state_shape, _F32), _WG)
        detour = lambda name: s.get(name)  # noqa: E731  (interpret only)

        def checkpoints(c, slot, S, vn_hi, vn_lo):
            """The checkpoints of chunk c (module docstring); keys from the ring's (zero-padded) k tile."""
            kr_hi, kr_lo = s["kr_hi"], s["kr_lo"]
            k_c = tiles.load(k_s.at[slot]).astype(_F32)  # [C, K]
            tile = (CHUNK, head_k)
            G_c = tiles.by_row(tiles.load(G_s.at[slot], _ROW), tile)
            a_hi, a_lo = tiles.lhs(vn_hi, detour("x_hi_d")), tiles.lhs(vn_lo, detour("x_lo_d"))

            def one(m, carry):
                r = ck_pos_ref[m]
                at = jnp.maximum(r - 1, 0)
                inside = jnp.where(r > 0, 1.0, 0.0)  # r = 0: no rows below, decay exp(0): S itself
                before = plgpu.broadcasted_iota(jnp.int32, tile, 0, layout=_WG) < r
                G_r = G_s[slot, at]
                kr = jnp.where(before, k_c * jnp.exp(jnp.where(before, G_r - G_c, -jnp.inf)), 0.0)
                hi, lo = tiles.split(kr, dtype, 2)
                kr_hi[...] = hi
                kr_lo[...] = lo
                plgpu.commit_smem()
                (added,) = tiles.matmuls((state_shape, ((a_hi, kr_hi), (a_lo, kr_hi), (a_hi, kr_lo))))
                ckpt_ref.at[m, h, cols][...] = jnp.exp(G_r * inside) * S + added
                return carry

            start = ck_start_ref[c]
            lax.fori_loop(start, start + ck_count_ref[c], one, 0)

        def step(i, S):
            c, slot, half = first + i, lax.rem(i, stages), lax.rem(i, 2)
            # a global load, issued before the chain's wgmmas that it can land under
            has_ck = ck_count_ref[c] > 0 if has_checkpoints else None
            plgpu.barrier_wait(in_bar.at[slot])
            plgpu.barrier_wait(ag_ready.at[slot])
            s_hi, s_lo = tiles.split(S, dtype, 2)
            k_t = k_s.at[slot].T  # [K, C]
            v_t = tiles.load(v_s.at[slot].T).astype(_F32)  # [BV, C]
            if map_mode:
                v_t = jnp.where(identity, jnp.zeros_like(v_t), v_t)
            G_col = tiles.load(G_s.at[slot], _COL)  # [C]: per column of the [BV, C] tiles
            G_last = G_s[slot, CHUNK - 1]  # padded rows have g = 0: the last real token's G

            def publish_state():
                @pl.when(i >= 2)
                def _():
                    plgpu.barrier_wait(s["s_free"].at[half])  # the output warpgroup read chunk i - 2's tiles

                s["s_pub"].at[half][...] = s_hi

            pairs = ((tiles.lhs(s_hi, detour("s_hi_d")), k_t), (tiles.lhs(s_lo, detour("s_lo_d")), k_t))[:terms]
            (ks,) = tiles.matmuls(((BLOCK_V, CHUNK), pairs), during=None if map_mode else publish_state)  # (k S)^T
            x = v_t - tiles.by_col(jnp.exp(G_col), ks.shape) * ks  # X^T [BV, C]
            x_hi, x_lo = tiles.split(x, dtype, 2)
            ag_t = ag_s.at[slot].T  # strictly lower Ag^T [C_j, C_i]
            diagonal = x * tiles.by_col(tiles.load(b_s.at[slot], _COL), x.shape)  # Ag's diagonal beta, in fp32
            pairs = ((tiles.lhs(x_hi, detour("x_hi_d")), ag_t), (tiles.lhs(x_lo, detour("x_lo_d")), ag_t))[:terms]
            (v_new,) = tiles.matmuls(((BLOCK_V, CHUNK), pairs))
            v_new = diagonal + v_new  # v_new^T [BV, C]
            vn_hi, vn_lo = tiles.split(v_new, dtype, 2)
            vd_hi, vd_lo = tiles.split(v_new * tiles.by_col(jnp.exp(G_last - G_col), v_new.shape), dtype, 2)

            def publish_values():
                s["vn_pub"].at[half].T[...] = vn_hi  # [C, BV]
                plgpu.commit_smem()
                plgpu.barrier_arrive(s["s_ready"].at[half])

            pairs = ((tiles.lhs(vd_hi, detour("x_hi_d")), k_s.at[slot]),
                     (tiles.lhs(vd_lo, detour("x_lo_d")), k_s.at[slot]))[:terms]
            (added,) = tiles.matmuls((state_shape, pairs), during=None if map_mode else publish_values)
            S_next = jnp.exp(G_last) * S + added
            if has_checkpoints:
                @pl.when(has_ck)
                def _():
                    checkpoints(c, slot, S, vn_hi, vn_lo)

            plgpu.barrier_arrive(in_free.at[slot])
            return S_next

        S = lax.fori_loop(0, count, step, S0)

        @tiles.real_lanes(lane, pad_lane)
        def _():
            end_ref.at[lane, h, cols][...] = S

        if not map_mode:
            def drain(i, carry):
                plgpu.barrier_wait(s["s_free"].at[lax.rem(i, 2)])
                return carry

            lax.fori_loop(jnp.maximum(count - 2, 0), count, drain, 0)

    @pl.when(wg == _OUTPUT)
    def _output():
        plgpu.set_max_registers(232, action="increase")

        def prepare(i):
            """Ag of chunk i, in place of its T0 tile, for the state warpgroup."""
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(in_bar.at[slot])
            t0 = tiles.load(ag_s.at[slot]).astype(_F32)  # [C, C]
            decay = _decayed_lower(tiles.load(G_s.at[slot], _ROW), tiles.load(G_s.at[slot], _COL), sq)
            ag = t0 * decay * tiles.by_col(tiles.load(b_s.at[slot], _COL), sq)
            # the diagonal (beta) is applied in fp32 by the state warpgroup (module docstring, precision)
            strict = tiles.iota(sq, 0) > tiles.iota(sq, 1)
            ag_s.at[slot][...] = jnp.where(strict, ag, 0.0).astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_arrive(ag_ready.at[slot])

        if map_mode:
            def step(i, carry):
                prepare(i)
                plgpu.barrier_arrive(in_free.at[lax.rem(i, stages)])
                return carry

            lax.fori_loop(0, count, step, 0)
            return

        q_s, s_pub, vn_pub, p_s = s["q_s"], s["s_pub"], s["vn_pub"], s["p_s"]
        o_land, o_tiled, o_rows = s["o_s"]  # one SMEM tile, three views (`tiles.token_staging`)
        o_full = o_tiled if interpret else o_land  # the interpreter keeps the views apart and copies any rows

        @pl.when(count > 0)
        def _():
            prepare(0)

        def chunk_output(i, length):
            slot, half = lax.rem(i, stages), lax.rem(i, 2)

            @pl.when(i + 1 < count)
            def _():
                prepare(i + 1)

            G_row = tiles.load(G_s.at[slot], _ROW)
            decay = _decayed_lower(G_row, tiles.load(G_s.at[slot], _COL), sq)
            (scores,) = tiles.matmuls((sq, ((q_s.at[slot], k_s.at[slot].T),)))
            p_s[...] = (scale * scores * decay).astype(dtype)  # decay is 0 above the diagonal
            plgpu.commit_smem()
            plgpu.barrier_wait(s["s_ready"].at[half])
            qs, pv = tiles.matmuls(((CHUNK, BLOCK_V), ((q_s.at[slot], s_pub.at[half].T),)),
                              ((CHUNK, BLOCK_V), ((p_s, vn_pub.at[half]),)))
            plgpu.barrier_arrive(s["s_free"].at[half])
            plgpu.barrier_arrive(in_free.at[slot])
            return (tiles.by_row(scale * jnp.exp(G_row), qs.shape) * qs + pv).astype(dtype)

        tiles.token_output(chunk_output, first=first, count=count, chunk_start=start_ref, chunk_len=len_ref,
                           tiled=o_tiled, whole=o_full, rows_s=o_rows, dst=o_ref.at[:, h, cols], pad=pad_ref,
                           pad_lane=lane == pad_lane)

    # a warpgroup exiting while another still issues wgmmas has faulted on sm_90 (`state`)
    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)


def gdn_fused_lanes(lane_first, lane_count, chunk_start, chunk_len, q, k, v, beta, G, T0, lane_init, checkpoints=None,
                    *, group, scale, num_tokens=None, map_mode=False, interpret=False, state_terms=2):
    """The fused GDN state loop over L lanes (module docstring, kernel 2), on `gdn_kkt`'s outputs.

    lane_first, lane_count  # i32[L]: lane l walks chunks lane_first[l], ..., + lane_count[l] - 1 (count 0: end =
                            # start; lanes never share a chunk)
    chunk_start, chunk_len  # i32[NC]: chunk c holds the packed tokens [chunk_start[c], + chunk_len[c]) (`ChunkLayout`)
    q, k                    # [H, NC, C, K] 16-bit chunk-major, rows past each chunk zero (`gdn_kkt`)
    v                       # [HV, NC, C, V]
    beta                    # fp32 [HV, NC, C], padding rows zero
    G                       # fp32 [HV, NC, C]: chunk-local inclusive cumulative log decay (padding rows: G_last)
    T0                      # [HV, NC, C, C] 16-bit: (I + strict_lower(beta_i k_i . k_j))^-1
    lane_init               # fp32 [L, HV, K, V] start states, or None (zeros)
    checkpoints             # `Checkpoints` or None
    `group` = HV // H, `scale` a Python number. `state_terms`: 2 (default) feeds the three products on the state
    chain (k S, X Ag_<, the update) hi + lo, 1 as one 16-bit term each (FLA's and jla's precision, one wgmma per
    product). `interpret`: False (GPU), True or a `plgpu.InterpretGPUParams`.

    Returns (o [num_tokens, HV, V] in the 16-bit dtype in token order (tokens from the end of the last lane's last
    chunk on zero, tokens of chunks outside every lane unspecified), lane_end fp32 [L, HV, K, V], checkpoint_states
    fp32 [max(M, 1), HV, K, V]) — the contract of `state.state_lanes`. map_mode=True (lane_init
    and checkpoints None; chunk_start, chunk_len and num_tokens unused): fp32 [L, HV, K, K + V] = [M | E], the lane's
    affine map S_end = M S_start + E.
    """
    if map_mode and (lane_init is not None or checkpoints is not None):
        raise ValueError("map_mode: lane_init and checkpoints must be None")
    if not map_mode and (chunk_start is None or chunk_len is None or num_tokens is None):
        raise ValueError("chunk_start, chunk_len, num_tokens: required for the outputs (map_mode=False)")
    if state_terms not in (1, 2):
        raise ValueError(f"state_terms: must be 1 or 2, got {state_terms!r}")
    num_v_heads, _, chunk_in, head_v = v.shape
    head_k = k.shape[-1]
    if chunk_in != CHUNK or head_k % BLOCK_V or head_v % BLOCK_V:
        raise ValueError(f"k, v: expected {CHUNK}-row chunks and K, V multiples of {BLOCK_V}, got {k.shape}, {v.shape}")
    dtype = k.dtype
    num_lanes = lane_first.shape[0]
    width = head_k + head_v if map_mode else head_v  # the columns of the carried state
    num_ckpt = checkpoints.checkpoint_pos.shape[0] if checkpoints is not None else 0
    has_checkpoints = num_ckpt > 0
    has_init = lane_init is not None
    stages = _stages(head_k, dtype, map_mode=map_mode, has_checkpoints=has_checkpoints)

    lane_first, lane_count = lane_first.astype(jnp.int32), lane_count.astype(jnp.int32)
    extra = []
    if not map_mode:
        chunk_start, chunk_len = chunk_start.astype(jnp.int32), chunk_len.astype(jnp.int32)
        lane_first, lane_count, pad = tiles.padding_lane(lane_first, lane_count, chunk_start, chunk_len, num_tokens)
        extra = [chunk_start, chunk_len, pad]
    grid_lanes = lane_first.shape[0]
    inputs = [lane_first, lane_count, G.astype(_F32), beta.astype(_F32), T0, k, v]
    inputs += [] if map_mode else [q, *extra]
    if has_init:
        inputs.append(lane_init.astype(_F32).swapaxes(-1, -2))  # [L, HV, V, K]
    if has_checkpoints:
        inputs += [x.astype(jnp.int32) for x in checkpoints]

    end_type = jax.ShapeDtypeStruct((num_lanes, num_v_heads, width, head_k), _F32)
    out_type = [end_type]
    if not map_mode:
        out_type = [jax.ShapeDtypeStruct((num_tokens, num_v_heads, head_v), dtype), end_type,
                    jax.ShapeDtypeStruct((max(num_ckpt, 1), num_v_heads, head_v, head_k), _F32)]
    swz = tiles.swizzled
    scratch = dict(
        k_s=swz((stages, CHUNK, head_k), dtype), v_s=swz((stages, CHUNK, BLOCK_V), dtype),
        ag_s=swz((stages, CHUNK, CHUNK), dtype), G_s=plgpu.SMEM((stages, CHUNK), _F32),
        b_s=plgpu.SMEM((stages, CHUNK), _F32),
        in_bar=plgpu.Barrier(num_arrivals=5 if map_mode else 6, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ag_ready=plgpu.Barrier(num_barriers=stages), done=plgpu.Barrier(num_arrivals=3))
    if not map_mode:
        scratch.update(
            q_s=swz((stages, CHUNK, head_k), dtype), s_pub=swz((2, BLOCK_V, head_k), dtype),
            vn_pub=swz((2, CHUNK, BLOCK_V), dtype), p_s=swz((CHUNK, CHUNK), dtype),
            o_s=tiles.token_staging((CHUNK, BLOCK_V), dtype),
            s_ready=plgpu.Barrier(num_barriers=2), s_free=plgpu.Barrier(num_barriers=2))
    if has_checkpoints:
        scratch.update(kr_hi=swz((CHUNK, head_k), dtype), kr_lo=swz((CHUNK, head_k), dtype))
    if interpret:
        scratch.update(s_hi_d=swz((BLOCK_V, head_k), dtype), s_lo_d=swz((BLOCK_V, head_k), dtype),
                       x_hi_d=swz((BLOCK_V, CHUNK), dtype), x_lo_d=swz((BLOCK_V, CHUNK), dtype))

    body = functools.partial(_fused_kernel, group=group, scale=float(scale), stages=stages, map_mode=map_mode,
                             has_init=has_init, has_checkpoints=has_checkpoints, terms=state_terms,
                             interpret=bool(interpret), pad_lane=None if map_mode else grid_lanes - 1)
    kernel = plgpu.kernel(
        body, out_type=tuple(out_type), scratch_types=scratch, grid=(grid_lanes, num_v_heads, width // BLOCK_V),
        grid_names=("l", "h", "j"), num_threads=3, thread_name="wg",
        # Lane semantics: SMEM tiles keep exactly the transforms given above (wgmma and TMA need them)
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=tiles.interpret_params(interpret),
        kernel_name="gdn_fused_lanes_map" if map_mode else "gdn_fused_lanes")
    outs = kernel(*inputs)
    if map_mode:
        return outs[0].swapaxes(-1, -2)
    o, lane_end, checkpoint_states = outs
    return o, lane_end.swapaxes(-1, -2), checkpoint_states.swapaxes(-1, -2)


def gdn_fused_pass(p, init, *, interpret=False, kkt_inverse="f16"):
    """`gdn_kkt` + `gdn_fused_lanes` over whole rows: `state.state_pass_v2`'s contract for GDN.
    `kkt_inverse`: `gdn_kkt`'s `inverse`.

    p     # `delta_rule.cumsum.prepare(..., per_channel_decay=False)`
    init  # fp32 [N, HV, K, V] or None (zeros)
    Returns (o [T', HV, V] in token order, padding tokens zero, final fp32 [N, HV, K, V], checkpoints fp32
    [max(M, 1), HV, K, V], padded entries unspecified); ValueError naming the reason when `supports` declines the
    call.
    """
    cumsum.check_qk_normalized(p, reader="gdn_fused_pass")
    reason = supports(p.q, p.k, p.v, p.beta, interpret=bool(interpret))
    if reason is not None:
        raise ValueError(reason)
    lay = p.lay
    group = p.v.shape[1] // p.q.shape[1]
    t0, q_c, k_c, v_c, beta_c = gdn_kkt(lay.chunk_start, lay.chunk_len, p.q, p.k, p.v, p.beta, group=group,
                                        interpret=interpret, inverse=kkt_inverse)
    checkpoints = None
    if lay.checkpoint_pos.shape[0]:
        ck_start, ck_count = checkpoint_ranges(lay, lay.chunk_len.shape[0])
        checkpoints = Checkpoints(ck_start, ck_count, lay.checkpoint_pos)
    return gdn_fused_lanes(lay.row_first_chunk, lay.row_num_chunks, lay.chunk_start, lay.chunk_len, q_c, k_c, v_c,
                           beta_c, p.G, t0, init, checkpoints, group=group, scale=p.scale, num_tokens=p.q.shape[0],
                           interpret=interpret)
