"""The KDA (per-key-channel decay) intra-chunk pass as one Pallas Mosaic GPU kernel: a drop-in for the Triton-lowered
KDA intra launches of `pallas_triton_delta.intra_v2(..., per_channel_decay=True)` (same outputs, chunk-major layouts
and dtypes; the math and the score factorisation are in `jaxckpt/ops/kda/README.md`).

Built on jax 0.11.2 with `plgpu.kernel` (grid (chunk, value head), one warpgroup per CTA, Hopper wgmma with 16-bit
operands and fp32 accumulation); on CPU it runs under Mosaic GPU's interpreter (`interpret=True` or a
`plgpu.InterpretGPUParams`). Per chunk c and value head h, with G the chunk-local inclusive cumulative log decay
(fp32 [C, K], `prepare`'s output):

1. TMA loads of the chunk's q and k rows [start, start + 64) (key head h // group), of G [C, K] twice (swizzled for
   the [C, K] tiles, untiled for single rows) and of the chunk-major beta row (made in XLA, padding rows 0: a
   [T, HV] column is strided, which TMA cannot read). q and k land untiled: chunk starts follow cu_seqlens, and a
   tiled TMA destination needs tile-aligned starts; G is chunk-major, so it lands straight in swizzled SMEM. Rows
   past the chunk's length are masked to zero in registers (`where`, so NaN padding stays out); G stays flat on
   them (their g loads as 0 in `_cumsum_kernel`).
2. The masked q and k go to swizzled tiles (exact, in the I/O dtype): every score level reads them again, and reads
   from the untiled landing tiles would be 8-way bank-conflicted. beta exp(G) K, the right-hand side of W, goes to
   swizzled SMEM (the input dtype, or bf16 (hi, lo) pairs for fp32 inputs); KD = K exp(G_last - G) and
   QG = scale Q exp(G) go out by TMA through the (now dead) landing tiles.
3. Scores, exact for any decay. Every strictly-lower pair (i, j) of the 64-row chunk lies in exactly one
   (lower half, upper half) quadrant of a 2s-row block, s = 32, 16, 8, 4, 2, 1 (32·32 + 2·16·16 + ... + 32·1·1 =
   2016 = 64·63/2 pairs). In the 2s-row block starting at b, r = b + s (the first row of its lower half) satisfies
   j < r <= i for all of that quadrant's pairs, so per channel G_i <= G_r <= G_j (g <= 0) and
   exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j) with both factors <= 1. With R_s the [C, K] tile whose row i holds
   G's row r_s(i) and E_s = exp(where(lower half, G - R_s, R_s - G)) (every exponent <= 0: nothing is ever
   exponentiated above 0), X = K ⊙ E_s holds the left factors in its lower-half rows and the right factors in its
   upper-half rows, Y = Q ⊙ E_s the query-side left factors; X X^T and Y X^T, masked to the level's quadrants, are
   that level's key and query scores (the other entries pair factors of different blocks and are dropped). One
   level is one [C, K] exp and two 64-row wgmmas sharing X^T; six levels cover the chunk. The Triton kernels' 16-row
   scheme (a reference row per sub-chunk for the off-diagonal blocks, a 4-level split of the diagonal ones) would
   take 7 products per score kind of the same size here, since a wgmma tile has at least 64 rows, and 8 [C, K] exps
   (one left factor, one right factor per sub-chunk reference, one per diagonal level).
   R_s is exact: each of the level's 32 / s reference rows is read from the untiled G as a [K] vector, broadcast
   and selected for its block (63 row reads and 57 [C, K] selects over the six levels, ALU work rather than a
   serial wgmma round trip). A wgmma gather Sel_s bf16(G) would be cheaper but inexact: the rounded r' would push
   one factor up to exp(2^-9 |G_r|), past fp32's range once |G| > 4.5e4, and row-shifted views of an untiled G
   (r_s(i) - i takes only 2s values) made the Mosaic GPU lowering of jax 0.11.2 run for minutes. The diagonal
   i = j (exp(0) = 1, query scores only) is the row sum of Q ⊙ K. An underflowed factor stands for a score below
   e^-87 |a_i| |k_j|.
4. AQK = scale (query scores) out; A = beta_i (key scores), strictly lower; T = (I + A)^-1 by recursive doubling on
   the whole tile (T_2 = I - A_1, T_2s = T_s - T_s (A_s T_s), A_s the part of A in the level-s quadrants: the exact
   block inverse, one 64-row wgmma per product) with every product on (hi, lo) splits (hi.hi + hi.lo + lo.hi,
   ~2^-16 relative). Meanwhile v lands (its TMA load is issued once the score phase's SMEM is dead, and overlaps the
   inverse); beta V goes to swizzled SMEM as beta exp(G) K did; W = T (beta exp(G) K), U = T (beta V) (T split), all
   by TMA stores into the chunk-major [HV, NC, C, ...] arrays.
Exps are ex2.approx (`approx_math`: one MUFU op and a multiply, as the Triton kernels' exp2) rather than libdevice's
expf; denormal results flush to 0, an underflow as above.

Precision. 16-bit inputs: the score operands X, Y are rounded to the input dtype (`score_parts=1`, the default:
one wgmma per product, ~2^-9 relative per operand, as jla's KDA kernels; the Triton kernel's TF32 scores carry
~2^-11) or split (`score_parts=2`: hi.hi + hi.lo + lo.hi, three wgmmas each, ~2^-16); the solve is always split;
W and U use 16-bit right-hand sides (as FLA; the Triton kernel's are TF32); outputs are rounded to the input dtype.
Measured in the interpreter (bf16, K = V = 64, rel-RMS vs float64): W, U ~2.3e-3 (Triton 1.6e-3), AQK 2.6e-3 with
score_parts 1 and 1.6e-3 with 2 (Triton 1.6e-3, the output rounding). fp32 inputs: every operand is split
(score_parts 2), ~3e-6 relative (the Triton kernel's IEEE fp32 dots: ~1e-7).

SMEM per CTA (`plgpu.RefUnion`: the score phase's tiles alias the solve phase's): bf16, K = V = 128: 186 KB
(score_parts 2: 218 KB), one CTA per SM; bf16, K = V = 64: 98 KB, two; fp32: 162 KB at K = 64 (V 64 or 128), and
K = 128 does not fit (`supports` declines it, naming the size).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxckpt.ops.common import pallas_mosaic_gpu_tiles as tiles

CHUNK = 64  # wgmma's M: one chunk is one accumulator tile
TUNING_KEYS = ("score_parts",)
LEVELS = (32, 16, 8, 4, 2, 1)  # half-block sizes s of the score split (module docstring, step 3)
SMEM_LIMIT = 227 * 1024  # sm_90's opt-in dynamic SMEM per CTA
SMEM_ALIGN = 1024  # what `plgpu.RefUnion` aligns every ref to (jax 0.11.2, `core.SMEM_ALIGNMENT`)
MAX_GRID_CHUNKS = 65535  # CUDA's cap on the grid's y dimension, where the chunk axis lands
_F32 = jnp.float32
_BF16 = jnp.bfloat16
_WG = plgpu.Layout.WGMMA
_ROWS = _WG.reduce(1)  # one value per row of a [C, N] WGMMA tile
_COLS = _WG.reduce(0)  # one value per column


def _smem_groups(head_k, head_v, io_dtype, score_parts):
    """(persistent refs, score-phase group, solve-phase group): the SMEM scratch of one CTA."""
    fp32 = io_dtype == _F32
    op_dtype, parts = (_BF16, 2) if fp32 else (io_dtype, 1)
    operand = lambda n, width, dtype=op_dtype: tiles.swizzled((n, CHUNK, width), dtype)
    plain = lambda width, dtype=io_dtype: plgpu.SMEM((CHUNK, width), dtype)
    persistent = [operand(parts, head_k), plgpu.SMEM((CHUNK,), _F32)]  # beta exp(G) K, beta
    scores = [plain(head_k), plain(head_k), tiles.swizzled((CHUNK, head_k), _F32),  # q, k (later KD, QG staging), G
              plgpu.SMEM((CHUNK, head_k), _F32),  # G again, untiled: row vectors are read from it
              tiles.swizzled((CHUNK, head_k), io_dtype), tiles.swizzled((CHUNK, head_k), io_dtype),  # masked q, k
              operand(score_parts, head_k), operand(score_parts, head_k),  # X, Y
              tiles.swizzled((CHUNK, CHUNK), io_dtype)]  # AQK staging
    solve = [plain(head_v), operand(parts, head_v),  # v landing, beta V
             operand(2, CHUNK), operand(2, CHUNK),  # the inverse's operands
             tiles.swizzled((CHUNK, head_k), io_dtype), tiles.swizzled((CHUNK, head_v), io_dtype)]  # W, U staging
    return persistent, scores, solve


def _nbytes(refs):
    size = 0
    for ref in jax.tree.leaves(refs):
        size = -(-size // SMEM_ALIGN) * SMEM_ALIGN
        size += math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize
    return size


def _smem_bytes(head_k, head_v, io_dtype, score_parts):
    persistent, scores, solve = _smem_groups(head_k, head_v, io_dtype, score_parts)
    return _nbytes(persistent + [plgpu.RefUnion(scores, solve)]) + SMEM_ALIGN  # + the barrier


def supports(q, k, v, beta, G, *, chunk=CHUNK, interpret=False, **tuning) -> str | None:
    """None when `kda_intra` can run the call, else the reason (so the caller can fall back)."""
    reason = tiles.input_reason(q, k, v, beta, G, chunk=chunk, tuning=tuning, tuning_keys=TUNING_KEYS,
                                G_shape="HV, NC, C, K")
    if reason is not None:
        return reason
    io_dtype = tiles.io_dtype(k, v)
    score_parts = tuning.get("score_parts", 2 if io_dtype == _F32 else 1)
    if score_parts not in (1, 2) or (io_dtype == _F32 and score_parts != 2):
        return f"tuning: score_parts must be 1 or 2 (2 for fp32 inputs), got {score_parts!r}"
    smem = _smem_bytes(q.shape[-1], v.shape[-1], io_dtype, score_parts)
    if smem > SMEM_LIMIT:
        return (f"SMEM: {jnp.dtype(io_dtype).name} at K = {q.shape[-1]}, V = {v.shape[-1]}, score_parts "
                f"{score_parts} needs {smem // 1024} KB per CTA, more than {SMEM_LIMIT // 1024} KB")
    if G.shape[1] > MAX_GRID_CHUNKS:
        return f"G: at most {MAX_GRID_CHUNKS} chunks per launch, got {G.shape[1]}"
    if not interpret:
        device = jax.devices()[0]
        if device.platform != "gpu" or getattr(device, "compute_capability", None) != "9.0":
            return f"backend: wgmma needs an sm_90 GPU (or interpret=True), got {device.device_kind!r}"
    return None


def _terms(buf, parts):
    return tuple(buf.at[p] for p in range(parts))


def _reference_rows(s, g_u):
    """R_s fp32 [C, K]: row i holds G's row r_s(i) exactly (module docstring, step 3): each of the level's 32 / s
    reference rows is read from g_u (G untiled) as a [K] vector, broadcast and selected for its 2s-row block."""
    rows = tiles.iota((CHUNK, g_u.shape[-1]), 0)
    R = None
    for b in range(0, CHUNK, 2 * s):
        row = tiles.by_col(plgpu.load(g_u.at[b + s], layout=_COLS), rows.shape)
        R = row if R is None else jnp.where(rows >= b, row, R)
    return R


def _level_scores(s, k_s, q_s, G, R, x_s, y_s, *, score_parts):
    """Level s of the score split (module docstring, step 3): (key, query) scores of its quadrants, fp32 [C, C].

    k_s, q_s: the masked swizzled [C, K] tiles (loaded again per level rather than held across levels); G, R fp32
    [C, K] (R from `_reference_rows`); x_s, y_s the (parts, C, K) operand tiles.
    """
    sq = (CHUNK, CHUNK)
    lower = lax.rem(tiles.iota(G.shape, 0), 2 * s) >= s
    E = jnp.exp(jnp.where(lower, G - R, R - G))  # every exponent <= 0
    tiles.store_parts(x_s, plgpu.load(k_s, layout=_WG).astype(_F32) * E, score_parts)
    tiles.store_parts(y_s, plgpu.load(q_s, layout=_WG).astype(_F32) * E, score_parts)
    plgpu.commit_smem()
    x_terms, y_terms = _terms(x_s, score_parts), _terms(y_s, score_parts)
    x_t = tuple(t.T for t in x_terms)
    kk, qk = tiles.dots((x_terms, x_t, sq), (y_terms, x_t, sq))
    keep = tiles.half_pairs(s)
    return jnp.where(keep, kk, 0.0), jnp.where(keep, qk, 0.0)


def _inverse(A, t_buf, p_buf):
    """(I + A)^-1 of a strictly lower-triangular fp32 [C, C] tile by recursive doubling (module docstring, step 4).

    t_buf, p_buf: swizzled 16-bit [2, C, C] SMEM for the (hi, lo) terms: T_s (both sides), A_s, then A_s T_s in p_buf.
    Returns the (hi, lo) terms of T in t_buf, the left operand of W and U.
    """
    sq = (CHUNK, CHUNK)
    T = jnp.where(tiles.iota(sq, 0) == tiles.iota(sq, 1), 1.0, 0.0) - jnp.where(tiles.half_pairs(1), A, 0.0)
    t_terms, p_terms = _terms(t_buf, 2), _terms(p_buf, 2)
    for s in (2, 4, 8, 16, 32):
        tiles.store_parts(t_buf, T, 2)
        tiles.store_parts(p_buf, jnp.where(tiles.half_pairs(s), A, 0.0), 2)
        plgpu.commit_smem()
        (prod,) = tiles.dots((p_terms, t_terms, sq))  # returns after the wgmmas finished reading p_buf
        tiles.store_parts(p_buf, prod, 2)
        plgpu.commit_smem()
        (update,) = tiles.dots((t_terms, p_terms, sq))
        T = T - update
    tiles.store_parts(t_buf, T, 2)
    plgpu.commit_smem()
    return t_terms


def _stage_out(stage, x, dst):
    """x [C, N] -> dst (GMEM) through the staging tile, once earlier TMA stores have finished reading theirs."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage[...] = x.astype(stage.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, dst)


def _kda_intra_kernel(start_ref, len_ref, q_ref, k_ref, v_ref, beta_ref, G_ref, w_ref, u_ref, kd_ref, qg_ref,
                      aqk_ref, kb_s, b_s, phases, bar, v_bar, *, group, scale, parts, score_parts):
    scores, (land_v, vb_s, t_buf, p_buf, w_stage, u_stage) = phases
    land_q, land_k, g_s, g_u, q_s, k_s, x_s, y_s, aqk_stage = scores
    c, h = lax.axis_index("c"), lax.axis_index("h")
    hk = lax.div(h, group)
    start, length = start_ref[c], len_ref[c]
    rows = pl.ds(start, CHUNK)
    plgpu.copy_gmem_to_smem(q_ref.at[rows, hk], land_q, bar)
    plgpu.copy_gmem_to_smem(k_ref.at[rows, hk], land_k, bar)
    plgpu.copy_gmem_to_smem(G_ref.at[h, c], g_s, bar)  # chunk-major, so tile-aligned: straight into swizzled SMEM
    plgpu.copy_gmem_to_smem(G_ref.at[h, c], g_u, bar)
    plgpu.copy_gmem_to_smem(beta_ref.at[h, c], b_s, bar)
    plgpu.barrier_wait(bar)

    def tokens(land):  # masked rows, fp32 [C, N]
        x = plgpu.load(land, layout=_WG).astype(_F32)
        return jnp.where(tiles.iota(x.shape, 0) < length, x, 0.0)

    # q and k are read once from their landing tiles (untiled, so bank-conflicted) and kept masked in swizzled
    # tiles (exact: the I/O dtype), which every score level reads again; the landing tiles then stage KD and QG
    G, k = plgpu.load(g_s, layout=_WG), tokens(land_k)
    b_row = plgpu.load(b_s, layout=_ROWS)
    k_s[...] = k.astype(k_s.dtype)
    tiles.store_parts(kb_s, k * tiles.by_row(b_row, k.shape) * jnp.exp(G), parts)
    plgpu.commit_smem()  # also a warpgroup barrier: every thread has read land_k
    # padding rows keep G flat: the last row is the last real token's
    G_last = plgpu.load(g_u.at[CHUNK - 1], layout=_COLS)
    _stage_out(land_k, k * jnp.exp(tiles.by_col(G_last, G.shape) - G), kd_ref.at[h, c])
    q = tokens(land_q)
    q_s[...] = q.astype(q_s.dtype)
    plgpu.commit_smem()
    _stage_out(land_q, scale * q * jnp.exp(G), qg_ref.at[h, c])

    sq = (CHUNK, CHUNK)
    kk = qk = jnp.zeros(sq, _F32)
    for s in LEVELS:
        G = plgpu.load(g_s, layout=_WG)
        level_kk, level_qk = _level_scores(s, k_s, q_s, G, _reference_rows(s, g_u), x_s, y_s,
                                           score_parts=score_parts)
        kk, qk = kk + level_kk, qk + level_qk
    rows_sq, cols_sq = tiles.iota(sq, 0), tiles.iota(sq, 1)
    q, k = (plgpu.load(x, layout=_WG).astype(_F32) for x in (q_s, k_s))
    qk = qk + jnp.where(rows_sq == cols_sq, tiles.by_row(jnp.sum(q * k, axis=1), sq), 0.0)
    _stage_out(aqk_stage, scale * qk, aqk_ref.at[h, c])
    A = jnp.where(rows_sq > cols_sq, tiles.by_row(b_row, sq) * kk, 0.0)

    # the solve phase's tiles alias the score phase's: v lands once the AQK store has read its staging tile, and
    # its load overlaps the inverse
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    plgpu.copy_gmem_to_smem(v_ref.at[rows, h], land_v, v_bar)
    T = _inverse(A, t_buf, p_buf)
    plgpu.barrier_wait(v_bar)
    v = tokens(land_v)
    tiles.store_parts(vb_s, v * tiles.by_row(b_row, v.shape), parts)
    plgpu.commit_smem()
    head_k, head_v = w_stage.shape[-1], u_stage.shape[-1]
    w, u = tiles.dots((T, _terms(kb_s, parts), (CHUNK, head_k)), (T, _terms(vb_s, parts), (CHUNK, head_v)))
    _stage_out(w_stage, w, w_ref.at[h, c])
    _stage_out(u_stage, u, u_ref.at[h, c])
    # the CTA may exit once its stores have read SMEM: the writes finish before the kernel counts as done
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def kda_intra(chunk_start, chunk_len, q, k, v, beta, G, *, chunk, group, scale, interpret=False, **tuning):
    """W, U, KD, QG and AQK of every chunk (what `intra_v2(..., per_channel_decay=True)` returns), on Mosaic GPU;
    ValueError naming the reason when `supports` declines the call.

    chunk_start, chunk_len  # i32[NC] from `jaxckpt.plan.layout.chunk_layout` (a row's chunks restart at its start)
    q, k                    # [T, H, K]
    v                       # [T, HV, V]
    beta                    # [T, HV]
    G                       # fp32 [HV, NC, C, K]: chunk-local inclusive cumsum of the log decay (`prepare`)
    `group` = HV // H, `scale` a Python number. `interpret`: True (or an `InterpretGPUParams`) runs Mosaic GPU's
    interpreter on CPU. Tuning: `score_parts` (1 or 2; 16-bit inputs only, default 1: the score operands rounded
    to the input dtype or split, module docstring).

    Returns (w [HV, NC, C, K], u [HV, NC, C, V], kd [HV, NC, C, K], qg [HV, NC, C, K], aqk [HV, NC, C, C]), all in
    the I/O dtype (promote(k, v); fp32 if that is 32 bits or wider), padding rows zero.
    """
    reason = supports(q, k, v, beta, G, chunk=chunk, interpret=bool(interpret), **tuning)
    if reason is not None:
        raise ValueError(reason)
    num_heads, head_k = q.shape[1:]
    num_v_heads, head_v = v.shape[1:]
    if num_v_heads != group * num_heads:
        raise ValueError(f"group: expected HV // H = {num_v_heads // num_heads}, got {group}")
    num_chunks = G.shape[1]
    io_dtype = tiles.io_dtype(k, v)
    fp32 = io_dtype == _F32
    score_parts = tuning.get("score_parts", 2 if fp32 else 1)
    q, k, v = (x.astype(io_dtype) for x in (q, k, v))

    beta_c = tiles.chunk_major_beta(chunk_start, chunk_len, beta, chunk=chunk)  # fp32 [HV, NC, C]

    persistent, scores, solve = _smem_groups(head_k, head_v, io_dtype, score_parts)
    chunk_array = lambda width: jax.ShapeDtypeStruct((num_v_heads, num_chunks, chunk, width), io_dtype)
    kernel = plgpu.kernel(
        functools.partial(_kda_intra_kernel, group=group, scale=float(scale), parts=2 if fp32 else 1,
                          score_parts=score_parts),
        out_type=(chunk_array(head_k), chunk_array(head_v), chunk_array(head_k), chunk_array(head_k),
                  chunk_array(chunk)),
        scratch_types=[*persistent, plgpu.RefUnion(scores, solve), plgpu.Barrier(num_arrivals=5),
                       plgpu.Barrier(num_arrivals=1)],
        grid=(num_chunks, num_v_heads), grid_names=("c", "h"), interpret=tiles.interpret_params(interpret),
        # exp as ex2.approx (one MUFU op and a multiply, as the Triton kernels' exp2) rather than libdevice's expf
        compiler_params=plgpu.CompilerParams(approx_math=True), kernel_name="kda_intra_mosaic_gpu",
    )
    return kernel(chunk_start, chunk_len, q, k, v, beta_c, G.astype(_F32))
