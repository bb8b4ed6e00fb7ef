"""The KDA (per-key-channel decay) intra-chunk pass as one Pallas Mosaic GPU kernel: a drop-in for the Triton-lowered
KDA intra launches of `delta_rule.pallas_triton.intra_v2(..., per_channel_decay=True)` (same outputs, chunk-major
layouts and dtypes; the math and the score factorisation are in `jaxckpt/ops/delta_rule/README.md`).

Built on jax 0.11.2 with `plgpu.kernel` (grid (chunk, value head), one warpgroup per CTA, Hopper wgmma with 16-bit
operands and fp32 accumulation); on CPU it runs under Mosaic GPU's interpreter (`interpret=True` or a
`plgpu.InterpretGPUParams`). G is the chunk-local inclusive cumulative log decay, formed in the kernel (step 1).

Why it is built this way. The first version (one CTA per SM at 186 KB of SMEM, several times slower than this one
on the H200: bench/README.md, kernel-level runs, `bench/results/mosaic_gpu_kda_intra_h200.log`; no profile was
taken, so these are causes read from its code) held whole [C, K] fp32 tiles in registers (64 per thread each: G,
the reference rows, the exps, q, k, next to the fp32 score sums), more than the 255 registers a thread has;
unrolled its six score levels into one long straight line of code; left layouts to Mosaic GPU's warpgroup-semantics
inference; and walked its score levels, ten split inverse products and W, U one blocking wgmma round trip after
another, with nothing else on the SM to fill the gaps. This version:

- Column slabs. Every [C, K] elementwise pass runs on 32-column slabs ([C, 32] fp32: 16 registers per thread), and a
  score is a sum over channels, so a level's products accumulate slab by slab into one wgmma accumulator: slab n's
  wgmmas run while slab n + 1's exps are computed (its operands are built in registers, then the kernel waits for the
  previous wgmmas before overwriting the one-slab operand tiles). Peak live state is the two running score sums, the
  level's two accumulators and one slab's temporaries, about 200 registers.
- Compact score code: two loops over the levels s = 32, 16 and s = 8 .. 1 (s = 2^(5 - n), shifts rather than
  divisions), the slabs unrolled inside them. The coarse levels read their reference rows from the untiled G and
  select them per block (`_reference`: one select per element at s = 16). At s <= 8 a row's reference row lies in
  its own warp's 16 rows of the WGMMA layout, so two warp shuffles per register pair move it there from the G slab
  already in registers (`tiles.reference_rows`) in place of the select chains, 56 selects per element over those
  four levels (the interpreter, which cannot run warp shuffles, keeps the selects, and so does `l2norm`, where the
  shuffles measured slower). Reading the finest levels' reference rows as row-shifted views of G instead measured
  slower on the H200 at 8K and 32K tokens (bench/README.md, "Variants measured and not taken"): the views' 8-way
  bank-conflicted loads cost more than the ALU work they replace. No wgmma is in flight across a loop edge (each
  level reads its accumulators before the next starts), which jla found necessary with jax 0.11.2.
- Lane lowering semantics: every register layout is the one written here (WGMMA, or its row or column reduction),
  so nothing is relaid out behind the code's back; lowering this kernel takes 3 s on a CPU (56 s with the
  warpgroup semantics' layout inference, before the level loop).
- Two CTAs per SM. SMEM drops to 107 KB (bf16, K = V = 128, as the lowering counts it; two CTAs need at most
  113 KB each of the SM's 228 KB): the landing pieces of q and k are read in place (32-column TMA boxes that land with
  the TMA swizzle, so WGMMA-layout reads are conflict-free) instead of copied, the score operands are one slab wide,
  KD, QG and W leave through the landing pieces of k and q, U through v's, and the solve phase's tiles alias the
  score phase's two G copies. One CTA's serial chain (scores, inverse, W and U) now overlaps the other's, as in the
  GDN kernel, whose fastest form runs two CTAs per SM (bench/README.md, kernel-level runs).
- An fp16 inverse (`inverse="f16"`; the "blocked" default keeps its merges): one wgmma and one stored term per doubling
  product instead of the split's three and two, a third of the inverse's tensor work and half its SMEM stores, all
  on the critical path. The argument and the numpy emulation are `intra`'s (same doubling, same
  bounds, and the same similarity D (I + A) D^-1 for keys of any norm, d_i from |k_i|^2 summed after the score
  phase; decays only shrink A's entries): fp16 keeps
  11 significant bits, TF32's class, and the outputs do not see it (their error is the 16-bit rounding of the
  right-hand sides and of the outputs). `inverse="split"` keeps the (hi, lo) products (~2^-16 relative), the only
  choice for fp32 inputs.
- A blocked inverse (`inverse="blocked"`, 16-bit inputs; the default there because it measured slightly faster
  than "f16" on the H200 at T 8192 and 32768, H 16, with outputs equal to "f16"'s against the Triton kernel to three
  digits, bench/README.md, kernel-level runs, `bench/results/mosaic_gpu_kda_intra_h200_blocked.log`; the score
  levels, not the inverse, dominate):
  `intra`'s "blocked" (its docstring: why, accuracy, the interpreter's fallback to the doubling
  from s = 2): the four 16 x 16 diagonal blocks of T solved exactly in fp32 by forward substitution
  (`tiles.block_diagonal_inverse`), then the fp16 levels s = 16, 32 only: 4 dependent products on the chain
  instead of 10. Its 18 KB pad tile takes the bytes of beta V's and the inverse's tiles (a third group of the
  union, after a spacer over the solve tiles live through the inverse): no extra SMEM.
Not done: register-A wgmmas for Y (saves one slab store per product; the interpreter takes only SMEM operands), a
persistent CTA that prefetches the next chunk (for GDN, several chunks per CTA measured slower than two CTAs per SM),
and fewer exps per element (six levels, six exps): jla 0.1.0 builds its KDA score operands from two levels, its
exponents bounded by a per-chunk check of the gate with an exact fallback; on an H100 at (1, 8192, 16) its cumsum,
score and solve kernels take 0.28 ms where this kernel took 0.40 with select chains at every level.

Per chunk c and value head h:

1. TMA loads: q and k rows [start, start + 64) (key head h // group) and the raw gate's (value head h) in 32-column
   boxes into swizzled landing pieces (no tiling: chunk starts follow cu_seqlens, and a tiled TMA destination needs
   tile-aligned starts), and the chunk-major beta row (made in XLA, padding rows 0: a [T, HV] column is strided,
   which TMA cannot read). Rows past the chunk's length are zeroed in place (`where`, so NaN padding stays out), and
   with `l2norm` every row of q and k is scaled to unit norm in place (the op's `use_qk_l2norm`, which an XLA pass
   before the launch would pay for with one more read and write of q and k). G, the chunk-local inclusive cumsum of
   the gate floored at `LOG_DECAY_FLOOR`, is formed here rather than by a launch of its own (which for KDA moved the
   fp32 [T, HV, K] gate and G once more through memory): per slab, G = L g on the tensor cores, L the [C, C]
   lower-triangular ones (exact in 16 bits) and g, with its padding rows 0 (so G stays flat on them), a sum of exact
   16-bit terms (two fp16 terms keep 22 of fp32's 24 significant bits, three bf16 terms all of them), each stored
   transposed so that it is a K-major B operand, and L from SMEM (as a register A operand, L gave wrong rows on the
   H100, rows 8-15 of each 16-row group, which the interpreter cannot show): fp32 accumulation, so G is a cumsum to
   fp32 rounding in another summation order. G goes over the gate's landing pieces, then into an untiled copy (single
   rows for the reference rows) whose bytes L and the term tiles held, and leaves for the state pass: every chunk's
   last row (its decay) and, at chunks that hold checkpoints, all its rows.
2. Scores, exact for any decay. Every strictly-lower pair (i, j) of the 64-row chunk lies in exactly one
   (lower half, upper half) quadrant of a 2s-row block, s = 32, 16, 8, 4, 2, 1 (32·32 + 2·16·16 + ... + 32·1·1 =
   2016 = 64·63/2 pairs). In the 2s-row block starting at b, r = b + s satisfies j < r <= i for all of that
   quadrant's pairs, so per channel G_i <= G_r <= G_j (g <= 0) and exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j)
   with both factors <= 1. With R_s row i = G's row r_s(i) and E_s = exp(where(lower half, G - R_s, R_s - G))
   (every exponent <= 0: nothing is ever exponentiated above 0), X = K ⊙ E_s holds the left factors in its
   lower-half rows and the right factors in its upper-half rows, Y = Q ⊙ E_s the query-side left factors; X X^T and
   Y X^T, masked to the level's quadrants, are that level's key and query scores. R_s is exact: each reference row
   is read from the untiled G as a [32] vector per slab, broadcast and selected for its block (ALU work; a wgmma
   gather of bf16(G) would round r and push a factor above 1). The diagonal i = j (query scores only) is the row
   sum of Q ⊙ K. An underflowed factor stands for a score below e^-87 |a_i| |k_j|.
3. From the last reads of q, k and G: KD = K exp(G_last - G) and QG = scale Q exp(G) written in place into the
   landing pieces and stored by TMA; beta exp(G) K, the right-hand side of W, kept in registers (16-bit) until the
   score phase's SMEM is dead, then stored; AQK = scale (query scores) staged and stored; v's TMA load issued (it
   lands under the inverse).
4. A = beta_i (key scores), strictly lower; T = (I + A)^-1 by recursive doubling on the whole tile (T_2 = I - A_1,
   T_2s = T_s - T_s (A_s T_s), A_s the part of A in the level-s quadrants: the exact block inverse, one 64-row wgmma
   per product); W = T (beta exp(G) K), U = T (beta V), stored by TMA through the landing pieces of k and v.
Exps are ex2.approx (`approx_math`: one MUFU op and a multiply, as the Triton kernels' exp2) rather than libdevice's
expf; denormal results flush to 0, an underflow as above.

Precision. 16-bit inputs: the score operands X, Y are rounded once to fp16 (`score_parts=1`, `score_dtype="float16"`,
the defaults: one wgmma per slab product, ~2^-12 relative per operand, the class of the Triton kernel's TF32 scores),
to the input dtype (`score_dtype="input"`: ~2^-9 for bf16, as jla's KDA kernels) or split (`score_parts=2`: hi.hi +
hi.lo + lo.hi, ~2^-16 with bf16 parts). fp16 has the range for it: every factor of E_s is exp(x <= 0) <= 1, so |X| <=
|k| and |Y| <= |q| (unit vectors when the op normalizes q and k, as the layers call it; any |q|, |k| below fp16's
65504 stays finite), and a factor that falls below fp16's normal range (6e-5) keeps an absolute error of at most
2^-25, next to scores of unit vectors; on the H200 parity problem bf16 operands gave KDA's output 4.10e-3 rel-RMS
against float64 and split ones 3.66e-3 (FLA 3.67e-3), at twice the score time (`bench/README.md`); W and U use 16-bit
right-hand sides (as FLA; the Triton kernel's are TF32) and T rounded once to the input dtype (fp16 inverse) or split
(split inverse);
outputs are rounded to the input dtype. Measured in the interpreter (bf16, K = V = 64, rel-RMS vs float64): W, U
~2.3e-3 with either inverse (Triton 1.6e-3), AQK 2.5e-3 with score_parts 1 and 1.6e-3 with 2 (Triton 1.6e-3, the
output rounding). fp32 inputs: every operand is split (score_parts 2, split inverse), ~3e-6 relative (the Triton
kernel's IEEE fp32 dots: ~1e-7).

SMEM per CTA as the lowering counts it (`plgpu.RefUnion`: the score phase's G copies and operand slabs alias the
solve phase's tiles), K = V = 128: bf16 107 KB, two CTAs per SM (inverse="blocked" the same; inverse="split":
123 KB, score_parts 2: 115 KB, one); fp32 211 KB. K = V = 64, bf16: 67 KB, three.
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
from jaxckpt.ops.common.log_decay import floor_log_decay
from jaxckpt.ops.delta_rule import cumsum
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import intra as mosaic_intra

CHUNK = 64  # wgmma's M: one chunk is one accumulator tile
SLAB = 32  # columns per landing piece and per elementwise slab: [C, 32] fp32 is 16 registers per thread
TUNING_KEYS = ("score_parts", "score_dtype", "inverse")
SCORE_DTYPES = ("input", "float16")
INVERSES = ("f16", "split", "blocked")
LEVELS = (32, 16, 8, 4, 2, 1)  # half-block sizes s of the score split (module docstring, step 2)
FINE_LEVELS = 2  # LEVELS[FINE_LEVELS:] (s <= 8) have their reference rows in each row's warp: warp shuffles
SMEM_LIMIT = tiles.SMEM_BYTES  # sm_90's opt-in dynamic SMEM per CTA
SMEM_ALIGN = 1024  # what `plgpu.RefUnion` aligns every ref to (jax 0.11.2, `core.SMEM_ALIGNMENT`)
_F32 = jnp.float32
_BF16 = jnp.bfloat16
_WG = plgpu.Layout.WGMMA
_ROWS = _WG.reduce(1)  # one value per row of a [C, N] WGMMA tile
_COLS = _WG.reduce(0)  # one value per column


def default_tuning(io_dtype):
    """The options `kda_intra` takes when not given: fp16 score operands and the "blocked" inverse (fp16 merges) for
    16-bit inputs; fp32 inputs split everything."""
    fp32 = jnp.dtype(io_dtype) == _F32
    return dict(score_parts=2 if fp32 else 1, score_dtype="input" if fp32 else "float16",
                inverse="split" if fp32 else "blocked")


def _landing(width, dtype):
    """[width / SLAB, C, SLAB] pieces with the TMA's swizzle (SLAB * itemsize bytes): one TMA box each, read and
    written in the WGMMA layout without bank conflicts, and no tiling, so unaligned chunk starts stay legal."""
    itemsize = jnp.dtype(dtype).itemsize
    return plgpu.SMEM((width // SLAB, CHUNK, SLAB), dtype, transforms=(plgpu.SwizzleTransform(SLAB * itemsize),))


def _smem_groups(head_k, head_v, io_dtype, score_parts, inverse, score_dtype="input"):
    """(persistent refs, the aliased groups: score phase, solve phase, the gate cumsum's L and term tiles and, for
    "blocked", the pad tile's): the SMEM scratch of one CTA."""
    fp32 = io_dtype == _F32
    op_dtype, parts = (_BF16, 2) if fp32 else (io_dtype, 1)
    score_op = jnp.float16 if score_dtype == "float16" else op_dtype
    # the split inverse's terms share W and U's right-hand sides' dtype (one wgmma type per product)
    inv_dtype, inv_parts = (op_dtype, 2) if inverse == "split" else (jnp.float16, 1)
    persistent = [plgpu.SMEM((CHUNK,), _F32), _landing(head_k, io_dtype), _landing(head_k, io_dtype)]  # beta, q, k
    scores = [_landing(head_k, _F32), plgpu.SMEM((CHUNK, head_k), _F32),  # G: pieces, untiled
              tiles.swizzled((score_parts, CHUNK, SLAB), score_op),  # X and Y, one slab
              tiles.swizzled((score_parts, CHUNK, SLAB), score_op)]
    solve = [tiles.swizzled((CHUNK, CHUNK), io_dtype), _landing(head_v, io_dtype),  # AQK staging (then T), v
             tiles.swizzled((parts, CHUNK, head_k), op_dtype), tiles.swizzled((parts, CHUNK, head_v), op_dtype),
             tiles.swizzled((inv_parts, CHUNK, CHUNK), inv_dtype), tiles.swizzled((inv_parts, CHUNK, CHUNK), inv_dtype)]
    # the gate cumsum's L and terms of g (`_gate_cumsum`), where the untiled G copy goes once they are read
    cumsum = [tiles.swizzled((CHUNK, CHUNK), score_op),
              *[tiles.swizzled((SLAB, CHUNK), score_op) for _ in range(_num_terms(score_op))]]
    groups = [scores, solve, [plgpu.SMEM((_nbytes(scores[:1]),), jnp.int8), *cumsum]]
    if inverse == "blocked":
        # the substitution's pad tile where beta V's and the inverse's tiles sit (dead until T_16 is in registers),
        # after a spacer over the solve tiles live through the inverse (AQK's staging, v's landing, beta exp(G) K):
        # `plgpu.RefUnion` lays each group out from byte 0 in SMEM_ALIGN steps (jax 0.11.2; `_nbytes` counts the same)
        groups.append([plgpu.SMEM((_nbytes(solve[:3]),), jnp.int8), tiles.substitution_pad()])
    return persistent, groups


def _nbytes(refs):
    size = 0
    for ref in jax.tree.leaves(refs):
        size = -(-size // SMEM_ALIGN) * SMEM_ALIGN
        size += math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize
    return size


def _smem_bytes(head_k, head_v, io_dtype, score_parts, inverse):
    persistent, groups = _smem_groups(head_k, head_v, io_dtype, score_parts, inverse)
    return _nbytes(persistent + [plgpu.RefUnion(*groups)]) + SMEM_ALIGN  # + the barriers


def supports(q, k, v, beta, g, *, num_chunks, chunk=CHUNK, interpret=False, **tuning) -> str | None:
    """None when `kda_intra` can run the call (`num_chunks`: the chunk layout's NC), else the reason (so the caller
    can fall back)."""
    reason = tiles.input_reason(q, k, v, beta, g, chunk=chunk, tuning=tuning, tuning_keys=TUNING_KEYS,
                                G_shape="T, HV, K")
    if reason is not None:
        return reason
    expected = (q.shape[0], v.shape[1], q.shape[2])
    if g.shape != expected:
        return f"g: expected the per-channel log decay [T, HV, K] = {expected}, got {g.shape}"
    io_dtype = tiles.io_dtype(k, v)
    fp32 = io_dtype == _F32
    tuning = {**default_tuning(io_dtype), **tuning}
    score_parts, inverse = tuning["score_parts"], tuning["inverse"]
    if score_parts not in (1, 2) or (fp32 and score_parts != 2):
        return f"tuning: score_parts must be 1 or 2 (2 for fp32 inputs), got {score_parts!r}"
    if inverse not in INVERSES or (fp32 and inverse != "split"):
        return f"tuning: inverse must be one of {INVERSES} ('split' for fp32 inputs), got {inverse!r}"
    if tuning["score_dtype"] not in SCORE_DTYPES or (fp32 and tuning["score_dtype"] != "input"):
        return (f"tuning: score_dtype must be one of {SCORE_DTYPES} ('input' for fp32 inputs), got "
                f"{tuning['score_dtype']!r}")
    smem = _smem_bytes(q.shape[-1], v.shape[-1], io_dtype, score_parts, inverse)
    if smem > SMEM_LIMIT:
        return (f"SMEM: {jnp.dtype(io_dtype).name} at K = {q.shape[-1]}, V = {v.shape[-1]}, {tuning} needs "
                f"{smem // 1024} KB per CTA, more than {SMEM_LIMIT // 1024} KB")
    return mosaic_intra.launch_reason(num_chunks, interpret=interpret)


def _terms(buf, parts):
    return tuple(buf.at[p] for p in range(parts))


def _slabs(land):
    return range(land.shape[0])


def _cols(j):
    return pl.ds(j * SLAB, SLAB)


def _row(g_rows, r, j):
    """G's row r (static or traced), columns of slab j, broadcast over a [C, SLAB] tile."""
    return tiles.by_col(plgpu.load(g_rows.at[r, _cols(j)], layout=_COLS), (CHUNK, SLAB))


def _quadrants(log_s):
    """[C, C] mask of level s = 2^log_s (traced): pairs in one 2s-row block, i in its lower half, j in its upper."""
    rows, cols = tiles.iota((CHUNK, CHUNK), 0), tiles.iota((CHUNK, CHUNK), 1)
    same = lax.shift_right_logical(rows, log_s + 1) == lax.shift_right_logical(cols, log_s + 1)
    return same & (lax.shift_right_logical(rows, log_s) & 1 == 1) & (lax.shift_right_logical(cols, log_s) & 1 == 0)


def _reference(log_s, j, g_rows):
    """Slab j of R_s, fp32 [C, SLAB]: row i holds G's row r_s(i) (module docstring, step 2), exactly: the level's
    32 / s reference rows, read as [SLAB] vectors, broadcast and selected in a loop over its blocks (16 selects per
    block and thread). The kernel's levels s = 32, 16, and every level under the interpreter."""
    rows = tiles.iota((CHUNK, SLAB), 0)
    s = lax.shift_left(1, log_s)

    def select(b, R):  # blocks b >= 1: rows from 2sb on take row 2sb + s
        return jnp.where(rows >= 2 * s * b, _row(g_rows, 2 * s * b + s, j), R)

    return lax.fori_loop(1, lax.shift_right_logical(32, log_s), select, _row(g_rows, s, j))


def _level_operands(log_s, j, land_q, land_k, g_pieces, g_rows, dtype, parts, shuffle):
    """Slab j of level s = 2^log_s's score operands (module docstring, step 2): the terms of X = K ⊙ E_s and
    Y = Q ⊙ E_s; `shuffle`: R_s by warp shuffles of G (levels s <= 8)."""
    G = plgpu.load(g_pieces.at[j], layout=_WG)
    R = tiles.reference_rows(G, log_s) if shuffle else _reference(log_s, j, g_rows)
    lower = lax.shift_right_logical(tiles.iota(G.shape, 0), log_s) & 1 == 1
    E = jnp.exp(jnp.where(lower, G - R, R - G))  # every exponent <= 0
    x = plgpu.load(land_k.at[j], layout=_WG).astype(_F32) * E
    y = plgpu.load(land_q.at[j], layout=_WG).astype(_F32) * E
    return tiles.split(x, dtype, parts), tiles.split(y, dtype, parts)


def _scores(land_q, land_k, g_pieces, g_rows, x_s, y_s, *, shuffle):
    """(key, query) scores of every strictly-lower pair, fp32 [C, C]: loops over the levels (one copy of the code per
    loop, for the instruction cache), each level slab by slab into two accumulators, a slab's operands built in
    registers while the previous slab's wgmmas run. `shuffle`: the levels s <= 8, whose reference rows lie in each
    row's warp, read them by warp shuffles (`tiles.reference_rows`) in a second loop."""
    parts = x_s.shape[0]
    sq = (CHUNK, CHUNK)

    def level(log_s, sums, by_shuffle):
        def body(acc_kk, acc_qk):
            for j in _slabs(land_k):
                x, y = _level_operands(log_s, j, land_q, land_k, g_pieces, g_rows, x_s.dtype, parts, by_shuffle)
                if j:
                    plgpu.wgmma_wait(0)  # the previous slab's wgmmas have read x_s and y_s
                for p in range(parts):
                    x_s.at[p][...] = x[p]
                    y_s.at[p][...] = y[p]
                plgpu.commit_smem()
                for a in range(parts):
                    for b in range(parts - a):
                        plgpu.wgmma(acc_kk, x_s.at[a], x_s.at[b].T)
                        plgpu.wgmma(acc_qk, y_s.at[a], x_s.at[b].T)
            return acc_kk[...], acc_qk[...]  # waits: no wgmma is in flight across a loop's back edge

        # the barrier keeps later arithmetic after the wait (`tiles.dots`)
        kk, qk = lax.optimization_barrier(pl.run_scoped(body, plgpu.ACC(sq, _F32), plgpu.ACC(sq, _F32)))
        keep = _quadrants(log_s)
        return sums[0] + jnp.where(keep, kk, 0.0), sums[1] + jnp.where(keep, qk, 0.0)

    zero = plgpu.layout_cast(jnp.zeros(sq, _F32), _WG)
    top = len(LEVELS) - 1  # log2 of the coarsest level
    by_selects = FINE_LEVELS if shuffle else len(LEVELS)
    sums = lax.fori_loop(0, by_selects, lambda n, sums: level(top - n, sums, False), (zero, zero))
    if shuffle:  # traced only here: the interpreter cannot run the shuffles, even in a loop of no trips
        sums = lax.fori_loop(by_selects, len(LEVELS), lambda n, sums: level(top - n, sums, True), sums)
    return sums


def _num_terms(dtype):
    """16-bit terms that carry an fp32 gate exactly enough: fp16 keeps 11 bits a term, bf16 8 (22 or 24 of 24)."""
    return 2 if jnp.dtype(dtype) == jnp.float16 else 3


def _gate_cumsum(g_pieces, g_rows, lower_s, term_tiles, valid):
    """G, the chunk-local inclusive cumsum of the floored log decay, from the raw gate landed in g_pieces: per slab
    G = L g on the tensor cores (L the [C, C] lower-triangular ones, exact in 16 bits, stored into lower_s; g as a sum
    of exact 16-bit terms stored transposed into term_tiles [SLAB, C], so each is a K-major B operand; module
    docstring, step 1), written over g_pieces; then g_rows, whose bytes lower_s and the term tiles share, takes G's
    rows. Rows past the chunk's length add 0, so G stays flat on them."""
    dtype = term_tiles[0].dtype
    sq = (CHUNK, CHUNK)
    for j in _slabs(g_pieces):
        rest = jnp.where(valid, floor_log_decay(plgpu.load(g_pieces.at[j], layout=_WG)), 0.0)
        if j == 0:  # after the first read of the gate (the interpreter orders writes to a `RefUnion` per buffer)
            lower_s[...] = jnp.where(tiles.iota(sq, 0) >= tiles.iota(sq, 1), 1.0, 0.0).astype(dtype)
        for tile in term_tiles:
            term = rest.astype(dtype)
            tile.T[...] = term
            rest = rest - term.astype(_F32)
        plgpu.commit_smem()
        G = tiles.matmul((CHUNK, SLAB), [(lower_s, tile.T) for tile in term_tiles])  # waits: the tiles are read
        g_pieces.at[j][...] = G
    plgpu.commit_smem()
    for j in _slabs(g_pieces):
        g_rows.at[:, _cols(j)][...] = plgpu.load(g_pieces.at[j], layout=_WG)
    plgpu.commit_smem()


def _inverse(A, t_buf, p_buf, *, pad=None):
    """(I + A)^-1 (fp32) of a strictly lower-triangular fp32 [C, C] tile by recursive doubling (module docstring,
    step 4); each product on t_buf's and p_buf's terms (one fp16 term, or bf16 (hi, lo)). pad (the "blocked"
    inverse off the interpreter, `tiles.substitution_pad`): T_16 from `tiles.block_diagonal_inverse`, then only the
    levels s = 16, 32."""
    sq = (CHUNK, CHUNK)
    parts = t_buf.shape[0]
    if pad is None:
        T = jnp.where(tiles.iota(sq, 0) == tiles.iota(sq, 1), 1.0, 0.0) - jnp.where(tiles.half_pairs(1), A, 0.0)
        levels = (2, 4, 8, 16, 32)
    else:
        T, levels = tiles.block_diagonal_inverse(A, pad), (16, 32)
    t_terms, p_terms = _terms(t_buf, parts), _terms(p_buf, parts)
    for s in levels:
        tiles.store_parts(t_buf, T, parts)
        tiles.store_parts(p_buf, jnp.where(tiles.half_pairs(s), A, 0.0), parts)
        plgpu.commit_smem()
        (prod,) = tiles.dots((p_terms, t_terms, sq))  # returns after the wgmmas finished reading p_buf
        tiles.store_parts(p_buf, prod, parts)
        plgpu.commit_smem()
        (update,) = tiles.dots((t_terms, p_terms, sq))
        T = T - update
    return T


def _store_pieces(land, x):
    """x [C, N] fp32 into the landing pieces (in place: each thread writes the elements it read)."""
    for j in _slabs(land):
        land.at[j][...] = x[:, j * SLAB:(j + 1) * SLAB].astype(land.dtype)


def _copy_out(land, dst):
    """The landing pieces -> dst (GMEM [C, N]), one TMA box each (after `commit_smem`)."""
    for j in _slabs(land):
        plgpu.copy_smem_to_gmem(land.at[j], dst.at[:, _cols(j)])


def _copy_in(src, land, bar):
    for j in _slabs(land):
        plgpu.copy_gmem_to_smem(src.at[:, _cols(j)], land.at[j], bar)


def _kda_intra_kernel(*refs, group, scale, parts, t_single, substitute, shuffle, has_checkpoints, l2norm):
    """`substitute`: T_16 by the substitution in the pad tile ("blocked" off the interpreter); `shuffle`: the fine
    levels' reference rows by warp shuffles (off the interpreter); `l2norm`: q's and k's rows normalized in place
    before anything reads them."""
    refs = list(refs)
    take = lambda n: [refs.pop(0) for _ in range(n)]  # noqa: E731
    start_ref, len_ref = take(2)
    ck_ref = refs.pop(0) if has_checkpoints else None
    q_ref, k_ref, v_ref, beta_ref, g_ref, w_ref, u_ref, kd_ref, qg_ref, aqk_ref, g_last_ref = take(11)
    G_ref = refs.pop(0) if has_checkpoints else None
    b_s, land_q, land_k, phases, bar, v_bar = take(6)
    (g_pieces, g_rows, x_s, y_s), (aqk_s, land_v, kb_s, vb_s, t_buf, p_buf), cumsum_group, *pad_group = phases
    _, lower_s, *term_tiles = cumsum_group
    pad = pad_group[0][1] if substitute else None
    c, h = lax.axis_index("c"), lax.axis_index("h")
    hk = lax.div(h, group)
    start, length = start_ref[c], len_ref[c]
    rows = pl.ds(start, CHUNK)
    _copy_in(q_ref.at[rows, hk], land_q, bar)
    _copy_in(k_ref.at[rows, hk], land_k, bar)
    _copy_in(g_ref.at[rows, h], g_pieces, bar)
    plgpu.copy_gmem_to_smem(beta_ref.at[h, c], b_s, bar)
    plgpu.barrier_wait(bar)

    slab = (CHUNK, SLAB)
    valid = tiles.iota(slab, 0) < length
    _gate_cumsum(g_pieces, g_rows, lower_s, term_tiles, valid)
    # G leaves for the state pass: its last row (every chunk's decay) and, at chunks that hold checkpoints, its rows
    plgpu.copy_smem_to_gmem(g_rows.at[CHUNK - 1], g_last_ref.at[h, c])
    if has_checkpoints:
        @pl.when(ck_ref[c] > 0)
        def _():
            plgpu.copy_smem_to_gmem(g_rows, G_ref.at[h, c])
    # rows past the chunk's length zeroed in place, once (every later read sees them), and with `l2norm` scaled to
    # unit norm (the squared norms summed over the slabs first); the diagonal of the query scores (exp(0) = 1) on
    # the way
    landed = lambda land, j: jnp.where(valid, plgpu.load(land.at[j], layout=_WG).astype(_F32), 0.0)  # noqa: E731
    if l2norm:
        # the slabs' squares summed elementwise first: one cross-lane row reduction per tensor, not one per slab
        inv_norms = [cumsum.l2_scale(jnp.sum(sum(jnp.square(landed(land, j)) for j in _slabs(land)), axis=1))
                     for land in (land_q, land_k)]
    diag = None
    for j in _slabs(land_k):
        q, k = landed(land_q, j), landed(land_k, j)
        if l2norm:
            q, k = (x * tiles.by_row(r, slab) for x, r in zip((q, k), inv_norms))
        land_q.at[j][...], land_k.at[j][...] = q.astype(land_q.dtype), k.astype(land_k.dtype)
        diag = jnp.sum(q * k, axis=1) if diag is None else diag + jnp.sum(q * k, axis=1)
    plgpu.commit_smem()

    sq = (CHUNK, CHUNK)
    kk, qk = _scores(land_q, land_k, g_pieces, g_rows, x_s, y_s, shuffle=shuffle)

    # the last reads of q, k and G: KD and QG in place in the landing pieces, beta exp(G) K in registers until the
    # score phase's SMEM (which the solve phase's tiles alias) is dead
    b_row = plgpu.load(b_s, layout=_ROWS)
    op_dtype = kb_s.dtype
    if l2norm:
        # unit (or zero) keys: the inverse's entries are at most beta_i unscaled, and `tiles.key_scales` would give
        # d = 1 at every |k|^2 in [0.5, 2), so the norms are not summed again
        b_d, d_inv = b_row, None
    else:
        # the key norms for the inverse's scaling (`tiles.key_scales`), summed here rather than before the scores
        # so that nothing more stays live through the score phase
        r2 = sum(jnp.sum(jnp.square(plgpu.load(land_k.at[j], layout=_WG).astype(_F32)), axis=1)
                 for j in _slabs(land_k))
        d, d_inv = tiles.key_scales(r2)
        b_d = b_row * d
    kb = []
    for j in _slabs(land_k):
        G = plgpu.load(g_pieces.at[j], layout=_WG)
        k = plgpu.load(land_k.at[j], layout=_WG).astype(_F32)
        q = plgpu.load(land_q.at[j], layout=_WG).astype(_F32)
        gamma = jnp.exp(G)
        kb.append(tiles.split(k * tiles.by_row(b_d, slab) * gamma, op_dtype, parts))  # D (beta exp(G) K)
        land_k.at[j][...] = (k * jnp.exp(_row(g_rows, CHUNK - 1, j) - G)).astype(land_k.dtype)  # padding: G flat
        land_q.at[j][...] = (scale * q * gamma).astype(land_q.dtype)
    plgpu.commit_smem()  # also a warpgroup barrier: the score phase's tiles are dead from here on
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # G's stores (long done) have read g_rows
    _copy_out(land_k, kd_ref.at[h, c])
    _copy_out(land_q, qg_ref.at[h, c])
    _copy_in(v_ref.at[rows, h], land_v, v_bar)
    for p in range(parts):
        kb_s.at[p][...] = jnp.concatenate([terms[p] for terms in kb], axis=1)
    rows_sq, cols_sq = tiles.iota(sq, 0), tiles.iota(sq, 1)
    aqk_s[...] = (scale * (qk + jnp.where(rows_sq == cols_sq, tiles.by_row(diag, sq), 0.0))).astype(aqk_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(aqk_s, aqk_ref.at[h, c])

    A = tiles.by_row(b_d, sq) * kk  # D A D^-1
    A = A if d_inv is None else A * tiles.by_col(tiles.as_cols(d_inv, CHUNK), sq)
    T = _inverse(jnp.where(rows_sq > cols_sq, A, 0.0), t_buf, p_buf, pad=pad)
    if t_single:  # T rounded once to the input dtype, in AQK's staging tile once its store has read it
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        aqk_s[...] = T.astype(aqk_s.dtype)
        t_terms = (aqk_s,)
    else:
        tiles.store_parts(t_buf, T, t_buf.shape[0])
        t_terms = _terms(t_buf, t_buf.shape[0])
    plgpu.barrier_wait(v_bar)
    v = jnp.concatenate([plgpu.load(land_v.at[j], layout=_WG) for j in _slabs(land_v)], axis=1).astype(_F32)
    vb = jnp.where(tiles.iota(v.shape, 0) < length, v, 0.0) * tiles.by_row(b_d, v.shape)  # D (beta V)
    tiles.store_parts(vb_s, vb, parts)
    plgpu.commit_smem()
    head_k, head_v = kb_s.shape[-1], vb_s.shape[-1]
    w, u = tiles.dots((t_terms, _terms(kb_s, parts), (CHUNK, head_k)), (t_terms, _terms(vb_s, parts), (CHUNK, head_v)))
    if d_inv is not None:
        w, u = (x * tiles.by_row(d_inv, x.shape) for x in (w, u))  # D^-1 T' D (.)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # KD has left land_k
    _store_pieces(land_k, w)
    _store_pieces(land_v, u)
    plgpu.commit_smem()
    _copy_out(land_k, w_ref.at[h, c])
    _copy_out(land_v, u_ref.at[h, c])
    # the CTA may exit once its stores have read SMEM: the writes finish before the kernel counts as done
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def kda_intra(chunk_start, chunk_len, q, k, v, beta, g, *, chunk, group, scale, checkpoint_count=None, l2norm=False,
              interpret=False, **tuning):
    """W, U, KD, QG and AQK of every chunk (what `intra_v2(..., per_channel_decay=True)` returns), on Mosaic GPU, with
    G formed inside the kernel from the raw gate; ValueError naming the reason when `supports` declines the call.

    chunk_start, chunk_len  # i32[NC] from `jaxckpt.plan.layout.chunk_layout` (a row's chunks restart at its start)
    q, k                    # [T, H, K]
    v                       # [T, HV, V]
    beta                    # [T, HV]
    g                       # [T, HV, K] per-channel log decay (floored at `LOG_DECAY_FLOOR` here, as `prepare` does)
    checkpoint_count        # i32[NC]: checkpoints per chunk (`checkpoint_ranges`), or None (no checkpoints)
    `group` = HV // H, `scale` a Python number. `l2norm`: q's and k's rows normalized in the kernel as they land
    (`use_qk_l2norm`, as `cumsum.l2norm` would before the launch, without its pass over q and k). `interpret`: True
    (or an `InterpretGPUParams`) runs Mosaic GPU's interpreter on CPU. Tuning (`TUNING_KEYS`, module docstring;
    each left out takes `default_tuning`'s value): `score_parts` (1 or 2: the score operands rounded once or split;
    2 for fp32 inputs), `score_dtype` ("float16", the default for 16-bit inputs, or "input": the 16-bit type of the
    score operands; "input" for fp32), `inverse` ("f16", "split" or "blocked"; "split" for fp32 inputs).

    Returns (w [HV, NC, C, K], u [HV, NC, C, V], kd [HV, NC, C, K], qg [HV, NC, C, K], aqk [HV, NC, C, C]), all in
    the I/O dtype (promote(k, v); fp32 if that is 32 bits or wider), padding rows zero; then G's last rows G_last
    fp32 [HV, NC, K] (the chunks' decays) and G fp32 [HV, NC, C, K] whose chunks with checkpoints hold G (the
    others are never written), or None without checkpoints.
    """
    num_chunks = chunk_start.shape[0]
    mosaic_intra.check_launch(supports(q, k, v, beta, g, num_chunks=num_chunks, chunk=chunk,
                                       interpret=bool(interpret), **tuning), q, v, group=group)
    head_k = q.shape[-1]
    num_v_heads, head_v = v.shape[1:]
    io_dtype = tiles.io_dtype(k, v)
    fp32 = io_dtype == _F32
    tuning = {**default_tuning(io_dtype), **tuning}
    q, k, v = (x.astype(io_dtype) for x in (q, k, v))
    has_checkpoints = checkpoint_count is not None

    beta_c = tiles.chunk_major_beta(chunk_start, chunk_len, beta, chunk=chunk)  # fp32 [HV, NC, C]

    persistent, groups = _smem_groups(head_k, head_v, io_dtype, tuning["score_parts"], tuning["inverse"],
                                      tuning["score_dtype"])
    chunk_array = lambda width: jax.ShapeDtypeStruct((num_v_heads, num_chunks, chunk, width), io_dtype)  # noqa: E731
    out_type = [chunk_array(head_k), chunk_array(head_v), chunk_array(head_k), chunk_array(head_k), chunk_array(chunk),
                jax.ShapeDtypeStruct((num_v_heads, num_chunks, head_k), _F32)]
    if has_checkpoints:
        out_type.append(jax.ShapeDtypeStruct((num_v_heads, num_chunks, chunk, head_k), _F32))
    scratch = [*persistent, plgpu.RefUnion(*groups),
               plgpu.Barrier(num_arrivals=3 * head_k // SLAB + 1), plgpu.Barrier(num_arrivals=head_v // SLAB)]
    kernel = plgpu.kernel(
        functools.partial(_kda_intra_kernel, group=group, scale=float(scale), parts=2 if fp32 else 1,
                          t_single=tuning["inverse"] != "split",
                          substitute=tuning["inverse"] == "blocked" and not interpret,
                          # with l2norm the shuffles measured slower than the selects (bench/README.md, "KDA's
                          # reference rows by warp shuffles")
                          shuffle=not interpret and not l2norm,
                          has_checkpoints=has_checkpoints, l2norm=bool(l2norm)),
        out_type=tuple(out_type), scratch_types=scratch,
        grid=(num_chunks, num_v_heads), grid_names=("c", "h"), interpret=tiles.interpret_params(interpret),
        # exp as ex2.approx (one MUFU op and a multiply, as the Triton kernels' exp2) rather than libdevice's expf
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        kernel_name="kda_intra_mosaic_gpu",
    )
    counts = [checkpoint_count.astype(jnp.int32)] if has_checkpoints else []
    outs = kernel(chunk_start, chunk_len, *counts, q, k, v, beta_c, g.astype(_F32))
    return (*outs[:6], outs[6] if has_checkpoints else None)
