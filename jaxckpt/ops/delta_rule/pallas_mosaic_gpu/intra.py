"""The GDN (scalar decay) intra-chunk pass as one Pallas Mosaic GPU kernel: a drop-in for the Triton-lowered
`delta_rule.pallas_triton._intra_kernel_v2` (same outputs, layouts and dtypes; the math is in
`jaxckpt/ops/delta_rule/README.md`).

Built on jax 0.11.2 with `plgpu.kernel` (grid (chunk, value head), one warpgroup per CTA, Hopper wgmma); on CPU it
runs under Mosaic GPU's interpreter (`interpret=True` or a `plgpu.InterpretGPUParams`). Per chunk c and value head
h, with G the chunk-local inclusive cumulative log decay (`_cumsum_kernel`'s output):

1. TMA loads of the chunk's q, k (key head h // group) and v rows [start, start + 64) into plain SMEM, and of G and
   the chunk-major beta row (prepared in XLA, padding rows 0: a [T, HV] column is strided, which TMA cannot read).
   The landing tiles carry no tiling: a tiled (8, 64) TMA destination views GMEM as 8-row tiles, which needs
   tile-aligned starts and T % 8 == 0, while chunk starts follow cu_seqlens (they may carry the TMA's swizzle,
   `landing`). Rows past the chunk's length (the next row's tokens, padding, or rows past T, which TMA fills with
   0) are masked to zero in registers (`where`, so even NaN padding stays out).
2. From registers: the wgmma operands q, k, beta exp(G) k and beta v go to 128-byte-swizzled SMEM (every wgmma
   operand is an SMEM ref: the interpreter takes no register operands); KD = K exp(G_last - G) and
   QG = scale Q exp(G) go out through staging tiles (with `chunks_per_cta` > 1, through their landing tiles).
3. wgmma: S = K K^T and Q K^T (64 x 64, fp32 accumulators). AQK = scale tril(Q K^T exp(G_i - G_j)) and
   A = strictly-lower beta_i S_ij exp(G_i - G_j); exponents are masked to -inf before exp.
4. T = (I + A)^-1 by recursive doubling on the whole 64 x 64 tile, so every product is one M = 64 wgmma (suits
   wgmma better than 16 x 16 blocks): T_2 = I - A_1, then T_2s = T_s - T_s (A_s T_s) for s = 2, 4, 8, 16, 32, with
   A_s the part of A in the (lower half, upper half) quadrant of each 2s-row block. T_2s is the exact block inverse
   [[T11, 0], [-T22 A21 T11, T22]], so the only errors are those of the products. `inverse="split"`: each
   product runs on split operands, x = hi + lo with hi = bf16(x), lo = bf16(x - hi) (x to ~2^-17 relative), and
   hi.hi + hi.lo + lo.hi (three bf16 wgmmas, fp32 accumulation), ~2^-16 relative to |a| |b| per product.
   `inverse="f16"`: one fp16 wgmma per product (Tuning, below). `inverse="blocked"`: T_16 solved exactly in fp32
   by forward substitution (`tiles.block_diagonal_inverse`), then only the levels s = 16, 32 as "f16".
5. W = T (beta exp(G) K), U = T (beta V) with T split (hi + lo, two wgmmas each; one term of the I/O dtype with the
   fp16 inverse) and the right-hand sides rounded to the input dtype (as FLA); all five outputs go to the
   chunk-major [HV, NC, C, ...] arrays by TMA stores.

fp32 inputs take a precise path, not TF32: every operand is split as in step 4 (hi.hi + hi.lo + lo.hi), so the
outputs land at ~5e-6 relative (Triton's IEEE fp32 dots: ~1e-7). 16-bit inputs: K K^T and Q K^T are exact 16-bit
products with fp32 accumulation, as the Triton kernel's bulk dots.

Tuning (`gdn_intra`'s keyword options; `default_tuning` fills in those left out). Measured on an H200 before the
options (bf16, T 8192, H 16, K = V = 128), the kernel moved its ~250 MB of inputs and outputs at half the HBM
bandwidth, with the tensor cores about a third busy: one chunk per CTA runs load, a serial chain of dependent wgmmas
and store one after another, and only the SM's second CTA fills the gaps. The options shorten that chain or hide
work under it; each keeps the first form selectable ("split", 1, "rows") for A/B runs
(`bench/results/mosaic_gpu_intra_h200_variants.log`).

- `inverse` ("split" | "f16" | "blocked"; default "blocked" for 16-bit I/O, fp32 takes only "split"). The doubling is
  the CTA's critical path: 10 dependent products, each an SMEM round trip (registers to swizzled SMEM, fence and
  warpgroup barrier, wgmma, wait). "split" issues three wgmmas and stores two terms per operand; "f16" one wgmma and one
  term: a third of the inverse's tensor work and half its SMEM stores, all on that path. fp16 keeps 11 significant
  bits, as TF32 does (the Triton kernel's and FLA's merges), and lands in that class. Numpy emulation of this
  doubling (unit keys, beta ~ U(0, 1), 20 chunks per case), max |T - T_exact| / max |T|: fp16 7.3e-4 with keys
  0.9-correlated and no decay, 7.8e-4 at 0.99, 2.3e-4 uncorrelated; split 1.3e-5 / 1.9e-5; plain bf16 6.1e-3 /
  6.5e-3. The outputs do not see it: with bf16 I/O (decay on) the rel-RMS of W and U against float64 is 2.3-2.5e-3
  for split or fp16 inverses and T in W, U split or rounded once to bf16, dominated by rounding beta exp(G) K,
  beta V and the outputs to bf16; hence one term of T for W, U in this mode (it also frees 8 KB of SMEM, below).
  Range: fp16 ends at 65504 and goes subnormal below 6e-5 (absolute error <= 2^-25). A's entries are
  beta_i (k_i . k_j) exp(G_i - G_j): at most beta_i for unit keys, but up to beta_i |k_i| |k_j| for raw ones, and
  T's entries then scale with |k_j| / |k_i|, which fp16 cannot hold across keys of very different norms. So the
  kernel inverts the similar matrix D (I + A) D^-1 with D = diag(d), d_i a power of two within sqrt(2) of |k_i|
  (`tiles.key_scales`; 1 for keys of squared norm in [0.5, 2), so unit keys run exactly as before): its entries are
  at most 2 beta_i |k_i|^2 whatever the norms, T = D^-1 T' D exactly (powers of two), and the kernel forms
  W = D^-1 T' (D beta exp(G) K), U = D^-1 T' (D beta V) with D on the right-hand sides and D^-1 on the fp32
  products. For beta_i |k_i|^2 <= 2 (every transition I - beta k k^T contractive: unit keys with beta in [0, 2],
  the gated delta rule's range) the emulation's max |T'| stays near 1. Above 2 the recurrence itself expands
  (eigenvalue 1 - beta |k|^2 < -1 along k), T' grows as (beta |k|^2 - 1)^63 over a chunk, and the fp16 levels
  overflow once that passes 65504 (about beta |k|^2 > 2.4 for parallel keys), as the fp32 state itself does a few
  chunks later. `tests/ops/test_pallas_mosaic_gpu_intra.py::test_raw_keys_of_any_norm` covers raw, near-parallel
  keys over six decades of norm. With `l2norm` the kernel has made the keys unit (or zero) itself, A's entries are at
  most beta_i unscaled, and D = I is not formed (the KDA kernel likewise).
- `inverse="blocked"` (16-bit I/O, one chunk per CTA; the default there because it measured faster than "f16" on
  the H200 at T 8192 and 32768, H 16, with outputs equal to "f16"'s against the Triton kernel to three digits,
  bench/README.md, kernel-level runs, `bench/results/mosaic_gpu_intra_h200_blocked.log`): the chain shortened
  from 10 dependent products to 4. T_16, the inverses of the four 16 x 16 diagonal blocks, comes from forward
  substitution in fp32 registers
  (`tiles.block_diagonal_inverse`: -A stored to a plain fp32 [64, 72] SMEM tile, whose 72-word rows keep the
  WGMMA-layout transfers free of 8-way bank conflicts; each of 64 threads solves one column of its block in 15 dependent
  steps of FMAs on warp-broadcast SMEM reads; T_16 read back in WGMMA layout), exact up to fp32 rounding; then the fp16
  levels s = 16, 32. Same class as "f16": the numpy emulation above, 0.9 / 0.99 / 0-correlated keys, gives max |T -
  T_exact| / max |T| 8.9e-4 / 7.7e-4 / 1.8e-4 against 7.5e-4 / 7.7e-4 / 1.8e-4 for the "f16" doubling on the same chunks
  (`tests/ops/test_pallas_mosaic_gpu_intra.py` checks the loop). The substitution is Mosaic GPU code
  (`plgpu.inline_mgpu`) that Mosaic GPU's interpreter cannot run: under `interpret` the kernel doubles from s = 2 (the
  "f16" inverse), and the substitution is checked by its sm_90 lowering on CPU and by
  `tests/gpu/test_mosaic_gpu_intra.py` on the GPU.
- `chunks_per_cta` (n; 1, the default, is the kernel's first form, one chunk per CTA; more than 1 needs 16-bit
  I/O). Measured slower on the H200 (below), kept selectable for the record of why. A CTA walks n
  consecutive chunks of one value head and issues the next chunk's loads once the current chunk's landing tiles
  are consumed (right after the scores), so they arrive under the inverse and W, U; each chunk's stores drain
  under the next chunk's work (a chunk waits only for the previous stores to have read SMEM). The landing tiles
  are read first, so no double buffering is needed, which keeps two CTAs per SM (they still overlap each other's
  serial inverse) at 107 KB with the fp16 inverse (bf16, K = V = 128): KD and QG are staged in place in their
  landing tiles (two 16 KB tiles per chunk, bank conflicts and all with `landing="rows"`), W and U leave
  through the tiles of their right-hand sides, and beta exp(G) k waits in registers through the scores so that
  its tile shares bytes with k's and q's operands. With the split inverse this layout needs 123 KB: one CTA per SM,
  kept for the A/B only. It does not change the work's quantization (T 8192, H 16: 2048 chunks over 264 slots,
  8 in the busiest slot for every n), only the gaps in each CTA's timeline.
- `landing` ("rows" | "swizzled"; default "swizzled"). Every chunk reads its three landing tiles into registers
  (WGMMA layout) before its first wgmma, and with n > 1 writes KD and QG back into them. Row-major, with 256-byte
  rows (16-bit, K = 128), the 8 rows a warp touches per access start on the same bank: 8-way conflicts on 48 KB of
  reads per chunk (and 32 KB of writes with n > 1), all on the CTA's serial path. "swizzled" lands each 128-byte
  column piece of a tile as its own TMA box with the TMA's 128-byte swizzle, which spreads those 8 rows over all
  banks; no tiling is involved, so unaligned chunk starts stay legal. The price: K * itemsize / 128 boxes per tile
  instead of one (same bytes) and a register concatenation.

Measured after the options (H200, bf16, T 8192, H 16, K = V = 128; device time of the kernel, bench/README.md,
kernel-level runs, `bench/results/mosaic_gpu_intra_h200_variants.log`): "f16" + "swizzled" with one chunk per CTA
(then the default) was the fastest form, ahead of the first form ("split", 1, "rows"), of 4 or 8 chunks per CTA and
of "rows" landing with 4 per CTA, and all of them ahead of the Triton `_intra_kernel_v2`. The fp16 inverse and the
conflict-free landing pay; several chunks per CTA do not (the extra SMEM and the in-place staging cost more than
the overlap the second CTA per SM already gives). Every variant had the same error against the Triton kernel
(max-rel and rel-RMS of each output identical to three digits: W 2.4e-3, U 2.8e-3 rel-RMS, from the bf16 right-hand
sides).

Not done: folding the XLA beta prep (a small fraction of the kernel's time at T 8192, bench/README.md) into the
kernel needs a [64, HV] TMA box of the [T, HV] beta (HV * itemsize >= 16 bytes, not every head count) and a column
read out of SMEM; later, if the kernel nears its memory floor.

SMEM (`plgpu.RefUnion`s of groups with disjoint lifetimes). n = 1: the landing tiles; q's operand and the score
outputs' staging; the inverse's operands and the W, U staging. bf16, K = V = 128: 99 KB per CTA (either inverse),
so two CTAs share an H100/H200 SM (one CTA's loads and stores overlap the other's math); fp32, K = V = 128:
195 KB, one CTA. "blocked" adds the substitution's 18 KB pad tile as a group of its own (live from the
scores' last store to T_16 in registers), within the largest group's bytes: two CTAs per SM as before. n > 1: the
landing tiles and beta v's operand live through a chunk; k's and q's operands until the scores, then beta exp(G)
k's, the inverse's operands and AQK's staging tile (which, with the fp16 inverse, then holds T for W and U).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxckpt.ops.common import device
from jaxckpt.ops.common import pallas_mosaic_gpu_tiles as tiles
from jaxckpt.ops.delta_rule import cumsum

CHUNK = 64  # wgmma's M: one chunk is one accumulator tile
TUNING_KEYS = ("inverse", "chunks_per_cta", "landing")
INVERSES = ("split", "f16", "blocked")
LANDINGS = ("rows", "swizzled")
# CUDA's cap on a grid's y and z dimensions. Mosaic GPU launches a grid reversed onto (x, y, z): the chunk axis of
# a (chunk, value head) grid lands on y, the first axis of a three-axis grid on z
MAX_GRID_YZ = 65535
_F32 = jnp.float32
_WG = plgpu.Layout.WGMMA
_ROWS = _WG.reduce(1)  # one value per row of a [C, N] WGMMA tile
_COLS = _WG.reduce(0)  # one value per column


def supports(q, k, v, beta, G, *, chunk=CHUNK, interpret=False, **tuning) -> str | None:
    """None when `gdn_intra` can run the call, else the reason (so the caller can fall back)."""
    reason = tiles.input_reason(q, k, v, beta, G, chunk=chunk, tuning=tuning, tuning_keys=TUNING_KEYS,
                                G_shape="HV, NC, C")
    if reason is not None:
        return reason
    wide = tiles.io_dtype(k, v).itemsize >= 4
    if tuning.get("inverse", INVERSES[0]) not in INVERSES:
        return f"inverse: must be one of {INVERSES}, got {tuning['inverse']!r}"
    if wide and tuning.get("inverse") in ("f16", "blocked"):
        return f"inverse: {tuning['inverse']!r} needs 16-bit inputs (fp32 ones take the precise 'split' path)"
    if tuning.get("landing", LANDINGS[0]) not in LANDINGS:
        return f"landing: must be one of {LANDINGS}, got {tuning['landing']!r}"
    per_cta = tuning.get("chunks_per_cta", 1)
    if not isinstance(per_cta, int) or per_cta < 1:
        return f"chunks_per_cta: must be a positive int, got {per_cta!r}"
    if wide and per_cta > 1:
        return "chunks_per_cta: more than 1 needs 16-bit inputs (fp32 tiles do not fit in SMEM twice)"
    if per_cta > 1 and tuning.get("inverse") == "blocked":
        return "chunks_per_cta: more than 1 takes inverse 'f16' or 'split' ('blocked' has no SMEM to spare there)"
    return launch_reason(G.shape[1], chunks_per_cta=per_cta, interpret=interpret)


def grid_reason(num_chunks, *, chunks_per_cta=1) -> str | None:
    """None when the chunk axis of a (chunk, value head) grid (both intra kernels, `gdn_kkt`) fits CUDA's cap, else
    the reason."""
    grid_chunks = -(-num_chunks // chunks_per_cta)
    if grid_chunks > MAX_GRID_YZ:
        return (f"G: {num_chunks} chunks at {chunks_per_cta} per CTA is a grid of {grid_chunks} CTAs along the chunk "
                f"axis, more than CUDA's {MAX_GRID_YZ} (grid y)")
    return None


def launch_reason(num_chunks, *, chunks_per_cta=1, interpret=False) -> str | None:
    """The launch checks both intra kernels share: `grid_reason` and, unless interpreted, an sm_90 GPU for wgmma."""
    reason = grid_reason(num_chunks, chunks_per_cta=chunks_per_cta)
    if reason is not None:
        return reason
    return None if interpret else device.hopper_reason()


def check_launch(reason, q, v, *, group):
    """What both intra wrappers raise before a launch: ValueError with `supports`' reason, or for a `group` that is
    not HV // H."""
    if reason is not None:
        raise ValueError(reason)
    if v.shape[1] != group * q.shape[1]:
        raise ValueError(f"group: expected HV // H = {v.shape[1] // q.shape[1]}, got {group}")


def _dot(lhs, rhs, shape):
    (out,) = tiles.dots((lhs, rhs, shape))
    return out


def doubling_inverse(A, t_buf, p_buf, lhs_buf=None, *, pad=None):
    """(I + A)^-1 of a strictly lower-triangular fp32 [C, C] tile by recursive doubling (module docstring, step 4).

    t_buf, p_buf: swizzled [parts, C, C] SMEM for the terms of the wgmma operands (bf16 (hi, lo) or one fp16 term,
    `inverse`): T_s (both sides), A_s, then A_s T_s in p_buf. Returns the terms of T in lhs_buf (default t_buf), the
    left operand of W and U. pad (`tiles.substitution_pad`, the "blocked" inverse off the interpreter): T_16 comes
    from `tiles.block_diagonal_inverse` and the doubling starts at s = 16.
    """
    sq = (CHUNK, CHUNK)
    parts = t_buf.shape[0]
    lhs_buf = t_buf if lhs_buf is None else lhs_buf
    if pad is None:
        eye = jnp.where(tiles.iota(sq, 0) == tiles.iota(sq, 1), 1.0, 0.0)
        T, s = eye - jnp.where(tiles.half_pairs(1), A, 0.0), 2
    else:
        T, s = tiles.block_diagonal_inverse(A, pad), tiles.BLOCK
    t_terms, p_terms = tuple(t_buf.at[p] for p in range(parts)), tuple(p_buf.at[p] for p in range(parts))
    while s < CHUNK:
        tiles.store_parts(t_buf, T, parts)
        tiles.store_parts(p_buf, jnp.where(tiles.half_pairs(s), A, 0.0), parts)
        plgpu.commit_smem()
        prod = _dot(p_terms, t_terms, sq)  # returns after the wgmmas finished reading p_buf
        tiles.store_parts(p_buf, prod, parts)
        plgpu.commit_smem()
        T = T - _dot(t_terms, p_terms, sq)
        s *= 2
    tiles.store_parts(lhs_buf, T, lhs_buf.shape[0])
    plgpu.commit_smem()
    return tuple(lhs_buf.at[p] for p in range(lhs_buf.shape[0]))


def _stage_out(stages, x, dst):
    """x [C, N] -> dst (GMEM) through the N-wide staging tile, once earlier stores have finished reading theirs.

    One tile per width: a TMA store needs a contiguous SMEM source, which a column slice of a tiled buffer is not.
    """
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage = stages[x.shape[-1]]
    stage[...] = x.astype(stage.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, dst)


def _decay(G_row, G_col):
    """exp(G_i - G_j) on i >= j, else 0 (masked to -inf before exp)."""
    sq = (CHUNK, CHUNK)
    diff = tiles.by_row(G_row, sq) - tiles.by_col(G_col, sq)
    return jnp.exp(jnp.where(tiles.iota(sq, 0) >= tiles.iota(sq, 1), diff, -jnp.inf))


def _strict_A(S, b_row, decay):
    """A = beta_i S_ij exp(G_i - G_j) strictly below the diagonal, else 0."""
    sq = (CHUNK, CHUNK)
    return jnp.where(tiles.iota(sq, 0) > tiles.iota(sq, 1), tiles.by_row(b_row, sq) * S * decay, 0.0)


def _landed(tile, length, l2norm):
    """`tiles.landed_tokens`, each row scaled to unit norm with `l2norm` (`use_qk_l2norm` applied in the kernel)."""
    x = tiles.landed_tokens(tile, length)
    return x * tiles.by_row(cumsum.l2_scale(jnp.sum(x * x, axis=1)), x.shape) if l2norm else x


def _issue_chunk(q_ref, k_ref, v_ref, G_ref, beta_ref, landing, vectors, bar, *, start, c, h, hk):
    """The loads of chunk c (tokens from `start`) of value head h, key head hk: q, k, v into their landing tiles, G
    into its row and column SMEM copies (a vector's row and column views need separate copies: layouts are inferred
    per ref) and beta, all counted on `bar`."""
    rows = pl.ds(start, CHUNK)
    for ref, land, head in zip((q_ref, k_ref, v_ref), landing, (hk, hk, h)):
        tiles.land(ref.at[rows, head], land, bar)
    g_row_s, g_col_s, b_row_s = vectors
    plgpu.copy_gmem_to_smem(G_ref.at[h, c], g_row_s, bar)
    plgpu.copy_gmem_to_smem(G_ref.at[h, c], g_col_s, bar)
    plgpu.copy_gmem_to_smem(beta_ref.at[h, c], b_row_s, bar)


def _intra_kernel(start_ref, len_ref, q_ref, k_ref, v_ref, beta_ref, G_ref, w_ref, u_ref, kd_ref, qg_ref, aqk_ref,
                  aliased, k_s, kb_s, vb_s, g_row_s, g_col_s, b_row_s, bar, *, group, scale, parts, substitute,
                  l2norm):
    """One chunk per CTA (`chunks_per_cta=1`). `substitute`: T_16 by `tiles.block_diagonal_inverse` in the aliased
    pad tile ("blocked" off the interpreter); `l2norm`: q's and k's rows normalized as they are read."""
    (land_q, land_k, land_v), (q_s, score_stages), pad, (inv_bufs, wy_stages) = aliased  # pad: [] or [tile]
    c, h = lax.axis_index("c"), lax.axis_index("h")
    hk = lax.div(h, group)
    start, length = start_ref[c], len_ref[c]
    G_last = G_ref[h, c, CHUNK - 1]  # padding rows have g = 0: the last real token's cumulative decay
    _issue_chunk(q_ref, k_ref, v_ref, G_ref, beta_ref, (land_q, land_k, land_v), (g_row_s, g_col_s, b_row_s), bar,
                 start=start, c=c, h=h, hk=hk)
    plgpu.barrier_wait(bar)

    head_k, head_v = k_s.shape[-1], vb_s.shape[-1]
    G_row, b_row = plgpu.load(g_row_s, layout=_ROWS), plgpu.load(b_row_s, layout=_ROWS)
    gamma = jnp.exp(G_row)

    k = _landed(land_k, length, l2norm)
    if l2norm:  # unit (or zero) keys: D = I ("Range")
        b_d, d_inv = b_row, None
    else:
        d, d_inv = tiles.key_scales(jnp.sum(k * k, axis=1))
        b_d = b_row * d
    tiles.store_parts(k_s, k, parts)
    tiles.store_parts(kb_s, k * tiles.by_row(b_d * gamma, k.shape), parts)  # D (beta exp(G) K)
    v = tiles.landed_tokens(land_v, length)
    tiles.store_parts(vb_s, v * tiles.by_row(b_d, v.shape), parts)  # D (beta V)
    q = _landed(land_q, length, l2norm)
    plgpu.commit_smem()  # also a warpgroup barrier: the landing tiles are dead from here on
    _stage_out(score_stages, k * tiles.by_row(jnp.exp(G_last - G_row), k.shape), kd_ref.at[h, c])
    tiles.store_parts(q_s, q, parts)
    plgpu.commit_smem()

    sq = (CHUNK, CHUNK)
    k_terms = tuple(k_s.at[p] for p in range(parts))
    k_t = tuple(t.T for t in k_terms)
    qk, S = tiles.dots((tuple(q_s.at[p] for p in range(parts)), k_t, sq), (k_terms, k_t, sq))
    decay = _decay(G_row, plgpu.load(g_col_s, layout=_COLS))
    _stage_out(score_stages, scale * qk * decay, aqk_ref.at[h, c])
    _stage_out(score_stages, scale * q * tiles.by_row(gamma, q.shape), qg_ref.at[h, c])

    A = _strict_A(S, b_d, decay)  # D A D^-1
    A = A if d_inv is None else A * tiles.by_col(tiles.as_cols(d_inv, CHUNK), sq)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the score stages share their bytes with the inverse's
    T = doubling_inverse(A, *inv_bufs, pad=pad[0] if substitute else None)
    w, u = tiles.dots((T, tuple(kb_s.at[p] for p in range(parts)), (CHUNK, head_k)),
                 (T, tuple(vb_s.at[p] for p in range(parts)), (CHUNK, head_v)))
    if d_inv is not None:
        w, u = (x * tiles.by_row(d_inv, x.shape) for x in (w, u))  # D^-1 T' D (.)
    _stage_out(wy_stages, w, w_ref.at[h, c])
    _stage_out(wy_stages, u, u_ref.at[h, c])
    # the CTA may exit once its stores have read SMEM (as CUTLASS epilogues do): the writes finish before the
    # kernel counts as done
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _pipelined_kernel(start_ref, len_ref, q_ref, k_ref, v_ref, beta_ref, G_ref, w_ref, u_ref, kd_ref, qg_ref,
                      aqk_ref, land_q, land_k, land_v, vb_s, aliased, g_row_s, g_col_s, b_row_s, bar, *, group, scale,
                      per_cta, t_from_aqk_stage, l2norm):
    """`per_cta` consecutive chunks of one value head per CTA (`chunks_per_cta` > 1, 16-bit I/O): the next chunk's
    loads are issued once this chunk's landing tiles are consumed, and run under its scores, inverse and W, U."""
    (k_s, q_s), (kb_s, t_buf, p_buf, aqk_s) = aliased
    cb, h = lax.axis_index("c"), lax.axis_index("h")
    hk = lax.div(h, group)
    first = cb * per_cta
    end = jnp.minimum(first + per_cta, G_ref.shape[1])
    io_dtype = vb_s.dtype
    head_k, head_v = k_s.shape[-1], vb_s.shape[-1]
    sq = (CHUNK, CHUNK)

    def issue(c):
        _issue_chunk(q_ref, k_ref, v_ref, G_ref, beta_ref, (land_q, land_k, land_v), (g_row_s, g_col_s, b_row_s), bar,
                     start=start_ref[c], c=c, h=h, hk=hk)

    issue(first)

    @pl.loop(0, per_cta)
    def _chunk(n):
        c = first + n

        @pl.when(c < end)
        def _body():
            plgpu.barrier_wait(bar)
            length = len_ref[c]
            G_last = G_ref[h, c, CHUNK - 1]
            G_row, b_row = plgpu.load(g_row_s, layout=_ROWS), plgpu.load(b_row_s, layout=_ROWS)
            G_col = plgpu.load(g_col_s, layout=_COLS)
            gamma = jnp.exp(G_row)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's W, U have left kb_s (under k_s), vb_s
            k = _landed(land_k, length, l2norm)
            k_s.at[0][...] = k.astype(io_dtype)
            kb = (k * tiles.by_row(b_row * gamma, k.shape)).astype(io_dtype)  # held until k_s is dead (kb_s aliases it)
            v = tiles.landed_tokens(land_v, length)
            vb_s.at[0][...] = (v * tiles.by_row(b_row, v.shape)).astype(io_dtype)
            q = _landed(land_q, length, l2norm)
            q_s.at[0][...] = q.astype(io_dtype)
            tiles.store_in_place(land_k, k * tiles.by_row(jnp.exp(G_last - G_row), k.shape), kd_ref.at[h, c])  # KD
            tiles.store_in_place(land_q, scale * q * tiles.by_row(gamma, q.shape), qg_ref.at[h, c])  # QG

            k_t = (k_s.at[0].T,)
            qk, S = tiles.dots(((q_s.at[0],), k_t, sq), ((k_s.at[0],), k_t, sq))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # KD and QG have left the landing tiles

            @pl.when(c + 1 < end)
            def _prefetch():
                issue(c + 1)

            decay = _decay(G_row, G_col)
            aqk_s.at[0][...] = (scale * qk * decay).astype(io_dtype)
            kb_s.at[0][...] = kb
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(aqk_s.at[0], aqk_ref.at[h, c])
            A = _strict_A(S, b_row, decay)
            if t_from_aqk_stage:  # T's single term for W, U lands where AQK is staged
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                T = doubling_inverse(A, t_buf, p_buf, aqk_s)
            else:
                T = doubling_inverse(A, t_buf, p_buf)
            w, u = tiles.dots((T, (kb_s.at[0],), (CHUNK, head_k)), (T, (vb_s.at[0],), (CHUNK, head_v)))
            # W and U leave through their right-hand sides' tiles, which the finished wgmmas no longer read
            kb_s.at[0][...] = w.astype(io_dtype)
            vb_s.at[0][...] = u.astype(io_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(kb_s.at[0], w_ref.at[h, c])
            plgpu.copy_smem_to_gmem(vb_s.at[0], u_ref.at[h, c])

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def default_tuning(io_dtype, *, chunks_per_cta=1):
    """The options `gdn_intra` takes when not given (module docstring, "Tuning"): the fastest measured on the H200
    (`bench/results/mosaic_gpu_intra_h200_variants.log`, `bench/results/mosaic_gpu_intra_h200_blocked.log`): one chunk
    per CTA, swizzled landing tiles, the "blocked" inverse for 16-bit I/O ("f16" when `chunks_per_cta` > 1 is asked
    for, which "blocked" does not take); fp32 I/O takes the precise "split" inverse."""
    inverse = "split" if io_dtype.itemsize >= 4 else ("blocked" if chunks_per_cta == 1 else "f16")
    return dict(inverse=inverse, chunks_per_cta=1, landing="swizzled")


def gdn_intra(chunk_start, chunk_len, q, k, v, beta, G, *, chunk, group, scale, l2norm=False, interpret=False,
              **tuning):
    """W, U, KD, QG and AQK of every chunk (what `_intra_kernel_v2` writes), on Mosaic GPU; ValueError naming the
    reason when `supports` declines the call.

    chunk_start, chunk_len  # i32[NC] from `jaxckpt.plan.layout.chunk_layout` (a row's chunks restart at its start)
    q, k                    # [T, H, K]
    v                       # [T, HV, V]
    beta                    # [T, HV]
    G                       # fp32 [HV, NC, C]: chunk-local inclusive cumsum of the log decay (`_cumsum_kernel`)
    `group` = HV // H, `scale` a Python number. `l2norm`: q's and k's rows are normalized in the kernel as they are
    read (`use_qk_l2norm`, as `cumsum.l2norm` would before the launch, without its pass over q and k).
    `interpret`: True (or an `InterpretGPUParams`) runs Mosaic GPU's interpreter on CPU. `tuning` (`TUNING_KEYS`,
    module docstring): inverse ("split", "f16" or "blocked"),
    chunks_per_cta (a positive int) and landing ("rows" or "swizzled"); each left out takes `default_tuning`'s value.

    Returns (w [HV, NC, C, K], u [HV, NC, C, V], kd [HV, NC, C, K], qg [HV, NC, C, K], aqk [HV, NC, C, C]), all in
    the I/O dtype (promote(k, v); fp32 if that is 32 bits or wider), padding rows zero.
    """
    check_launch(supports(q, k, v, beta, G, chunk=chunk, interpret=bool(interpret), **tuning), q, v, group=group)
    head_k = q.shape[-1]
    num_v_heads, head_v = v.shape[1:]
    num_chunks = G.shape[1]
    io_dtype = tiles.io_dtype(k, v)
    tuning = {**default_tuning(io_dtype, chunks_per_cta=tuning.get("chunks_per_cta", 1)), **tuning}
    per_cta = tuning["chunks_per_cta"]
    q, k, v = (x.astype(io_dtype) for x in (q, k, v))
    # wgmma operands: the input dtype when 16-bit, else bf16 (hi, lo) splits
    op_dtype = jnp.bfloat16 if io_dtype == _F32 else io_dtype
    parts = 2 if io_dtype == _F32 else 1
    # the inverse's operands: (hi, lo) terms of op_dtype, or one fp16 term
    inv_dtype, inv_parts = (op_dtype, 2) if tuning["inverse"] == "split" else (jnp.float16, 1)
    blocked = tuning["inverse"] == "blocked"

    beta_c = tiles.chunk_major_beta(chunk_start, chunk_len, beta, chunk=chunk)  # fp32 [HV, NC, C]

    chunk_array = lambda width: jax.ShapeDtypeStruct((num_v_heads, num_chunks, chunk, width), io_dtype)
    vec = plgpu.SMEM((chunk,), _F32)
    operand = lambda width: tiles.swizzled((parts, chunk, width), op_dtype)
    inv_buf = lambda: tiles.swizzled((inv_parts, chunk, chunk), inv_dtype)
    if tuning["landing"] == "rows":
        landing = [plgpu.SMEM((chunk, d), io_dtype) for d in (head_k, head_k, head_v)]
    else:  # 128-byte column pieces, swizzled as TMA writes them (no tiling: chunk starts need not be 8-aligned)
        width = 128 // io_dtype.itemsize
        landing = [plgpu.SMEM((d // width, chunk, width), io_dtype, transforms=(plgpu.SwizzleTransform(128),))
                   for d in (head_k, head_k, head_v)]
    boxes = sum(1 if len(buf.shape) == 2 else buf.shape[0] for buf in landing)
    if per_cta == 1:
        stages = lambda *widths: {d: tiles.swizzled((chunk, d), io_dtype) for d in widths}  # one per distinct width
        # the split inverse leaves T's (hi, lo) in its own operand buffer; the fp16 one rounds T to op_dtype apart
        inv_bufs = (inv_buf(), inv_buf()) + (() if inv_parts == 2 else (tiles.swizzled((1, chunk, chunk), op_dtype),))
        # disjoint lifetimes: the landing tiles until they are read; then q's operand and the score outputs'
        # staging; then ("blocked") the substitution's pad tile until T_16 is in registers; then the inverse's
        # operands and the W, U staging
        pad = [tiles.substitution_pad()] if blocked else []
        aliased = plgpu.RefUnion(landing, [operand(head_k), stages(chunk, head_k)], pad,
                                 [inv_bufs, stages(head_k, head_v)])
        # the interpreter cannot run the substitution (Mosaic GPU code): it doubles from s = 2, the same T up to
        # rounding, and checks the rest of the kernel
        body = functools.partial(_intra_kernel, group=group, scale=float(scale), parts=parts,
                                 substitute=blocked and not interpret, l2norm=bool(l2norm))
        scratch = [aliased, operand(head_k), operand(head_k), operand(head_v)]
    else:
        # the landing tiles and vb_s live through a whole chunk; k_s and q_s until the scores, then kb_s (written
        # after them), the inverse's operands and AQK's staging tile
        aliased = plgpu.RefUnion([operand(head_k), operand(head_k)],
                                 [operand(head_k), inv_buf(), inv_buf(), tiles.swizzled((1, chunk, chunk), io_dtype)])
        body = functools.partial(_pipelined_kernel, group=group, scale=float(scale), per_cta=per_cta,
                                 t_from_aqk_stage=inv_parts == 1, l2norm=bool(l2norm))
        scratch = [*landing, operand(head_v), aliased]
    kernel = plgpu.kernel(
        body,
        out_type=(chunk_array(head_k), chunk_array(head_v), chunk_array(head_k), chunk_array(head_k),
                  chunk_array(chunk)),
        scratch_types=[*scratch, vec, vec, vec, plgpu.Barrier(num_arrivals=boxes + 3)],
        grid=(-(-num_chunks // per_cta), num_v_heads), grid_names=("c", "h"),
        interpret=tiles.interpret_params(interpret),
        kernel_name="gdn_intra_mosaic_gpu",
    )
    return kernel(chunk_start, chunk_len, q, k, v, beta_c, G)
