"""The gated delta rule (GDN: a scalar decay per token and value head; KDA: a decay per key channel) as Pallas kernels
for the Triton lowering (NVIDIA GPUs off Hopper, the fp32 path on Hopper; `interpret=True` on CPU), exporting
checkpoint states from inside the sequential pass: the entries `gated_delta_rule` and `kda`, their `supports`, and
the pipeline `delta_rule`.

The math (WY/UT form, in-chunk checkpoint formula) is in README.md beside this file. Four launches (five for KDA,
whose intra pass is two), FLA-like (`chunk_gated_delta_rule` / `chunk_kda`):

1. The gate cumsum (`cumsum.prepare`, grid (chunk, value head)): chunk-local inclusive cumulative log decay G,
   chunk-major [HV, NC, C(, K)] fp32, as hi + lo for fp32 I/O.
2. The intra pass (GDN: `_intra_kernel_v2`, grid (chunk, value head); KDA: two launches, below): everything that
   does not need the carried state, on 16-row sub-blocks (static loops over C / 16 <= 4 blocks, so no tile is ever
   sliced): A = strictly-lower beta-scaled key scores, T = (I + A)^-1, W = T (beta exp(G) K), U = T (beta V), and
   for the later passes KD = K exp(G_last - G), QG = scale Q exp(G) and the inclusive query scores
   AQK = scale tril(Q K^T exp(G_i - G_j)). T's diagonal 16x16 blocks by recursive doubling
   (T_2s = T_s - T_s A_s T_s, three pairs of IEEE dots, no loop), off-diagonal blocks by the block merge
   T_IJ = -T_II sum_{J<=k<I} A_Ik T_kJ.
3. `_state_kernel`, grid (row, value head, V block): S [K, BV] fp32 carried through the row's chunks,
   v_new = U - W S, S <- exp(G_last) S + KD^T v_new, writing the chunk-entry state h and v_new (or, with
   `fuse_output`, O = QG S + AQK v_new directly, making step 4 unnecessary). The chunk loop body is straight-line
   (Triton software-pipelines only innermost loops without branches): every step stores S by a masked store into
   the slot of the row's next checkpoint chunk (a CSR range of those chunks per row, precomputed in jnp; the next
   one rides in the carry, loaded a step ahead, so no step waits on it). `_checkpoint_kernel`, grid (checkpoint,
   value head, V block), then finishes each export from that entry state: v_new of the chunk again and
   exp(G_{r-1}) S + sum_{i<r} exp(G_{r-1} - G_i) k_i v_new_i^T in fp32 (r = 0 gives S exactly). The carried state
   never depends on the exports, so outputs and final states are bitwise unchanged by checkpoints. Token rows are
   addressed from the row start (a row's chunks are contiguous), so the loop loads no per-chunk metadata. Cutting
   the loop at the checkpoint chunks instead (the export inside the loop) cost more on the H200
   (bench/README.md, "Variants measured and not taken").
4. `_output_kernel`, grid (chunk, value head, V block): O = QG h + AQK v_new.

KDA's intra pass (step 2). Per-channel decay makes every score a channel sum sum_c a_ic k_jc exp(G_ic - G_jc). An
off-diagonal 16x16 block (i in sub-chunk I, j in sub-chunk J < I) is one tensor-core dot of (a_i exp(G_i - G_r)) and
(k_j exp(G_r - G_j)), r the first row of sub-chunk I (both factors <= 1: G is non-increasing and i >= r > j); a
diagonal block is exact: `_diag_block_scores` splits every strictly-lower pair into the (lower half, upper half)
quadrant of one 2s-row block, s = 8, 4, 2, 1, and factorises there about the block's middle row, both factors <= 1
again, so the scores are exact without a gate bound, at one exp and one dot per level; the derivation is in
README.md. What a program holds decides the speed: a [16, K] x [K, 16] dot keeps both operands
whole in every warp (64 + 64 fp32 registers per thread at K = 128), so the pass is two launches of small programs.
Launch A (`_kda_scores_kernel`, grid (chunk, head, sub-chunk I)) writes row block I of the beta-scaled key scores
(fp32 [HV, NC, C, C]), the query scores, KD and QG, the K axis in column blocks of `kda_block_k` (default 32): 140
registers, no spills. Launch B (`_kda_solve_kernel`, grid (chunk, head)) reads the key scores and solves T, W, U row
block by row block, every [16, K]-sized operand loaded again where it is used (L1/L2 hits) instead of held: 200
registers, no spills. It costs one fp32 [C, C] round trip (16 KB) per chunk and head; one program per chunk holding
every sub-chunk spilled (`bench/README.md`, "Variants measured and not taken").
Exps in these kernels are exp2(x log2 e) (one MUFU.EX2; libdevice's expf, what jnp.exp lowers to, is about 8
instructions).

Varlen rows and checkpoints come from `jaxckpt.plan.layout.chunk_layout(..., xp=jnp)` (traced metadata, one compile
per shape), passed as ordinary int32 refs: the Triton lowering has no scalar prefetch, so scalars are read in-kernel
and packed token tiles are loaded with `pl.ds(start, static size)` and row masks (other=0, so a padded row is a
no-op of the recurrence: k = v = beta = g = 0). Intermediates (W, U, v_new, h) live in a padded chunk-major layout
[HV, NC, C | K, ...], so those loads are unmasked and every tile is a power of two.

Precision. fp32 inputs: every dot at Precision.HIGHEST (IEEE fp32; interpret mode on CPU computes in fp32 anyway).
16-bit inputs: intermediates W, U, KD, QG, AQK, v_new, h are stored in the input dtype (as FLA), the bulk products
(GDN's K K^T and Q K^T, Q h or QG S, A v_new) are 16-bit x 16-bit dots with fp32 accumulation, and the
accuracy-critical ones (KDA scores, solve merges, W, U, the state update and the checkpoint export) run on fp32
operands at default precision, i.e. TF32 on the GPU; the 16x16 diagonal inverses are IEEE fp32. The carried state,
final and checkpoint states are fp32 throughout.

The log decays g must be <= 0 (every gate formula gives that): the factorisations rely on exp(G_i - G_j) <= 1 for
j <= i; the masked exponents are set to -inf before exp, never exponentiated unmasked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxckpt.ops.common import device
from jaxckpt.ops.common.checkpoint_chunks import checkpoint_chunk_ranks, checkpoint_segments
from jaxckpt.ops.common.contract import kernel_dtype_reason, tuning_reason
from jaxckpt.ops.common.pallas_triton_tiles import CumsumRefs, Dots, load_tokens, row_mask
from jaxckpt.ops.common.pallas_triton_tiles import exp2e as _exp
from jaxckpt.ops.delta_rule import cumsum
from jaxckpt.ops.delta_rule.backend import gate_reason, kernel_entries
from jaxckpt.ops.delta_rule.cumsum import gate_block, intermediate_dtype

CHUNK_SIZES = (16, 32, 64)
SUB = 16
MAX_HEAD_DIM = 256
TUNING_KEYS = ("num_warps", "num_stages", "block_v", "intra_num_warps", "output_block_v", "fuse_output",
               "kda_block_k")
_HIGHEST = jax.lax.Precision.HIGHEST
_F32 = jnp.float32


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports(q, k, v, g, beta, *, chunk_size=64, interpret=False, **tuning) -> str | None:
    """None when `gated_delta_rule` (g [T, HV]) or `kda` (g [T, HV, K]) can run the call here, else the reason (so
    the caller can fall back to XLA)."""
    reason = gate_reason(q, g)
    if reason is not None:
        return reason
    if g.ndim == 2 and tuning.get("kda_block_k") is not None:
        return "tuning: kda_block_k tunes KDA's intra pass; this is a GDN call"
    reason = tuning_reason(tuning, TUNING_KEYS, chunk_size=chunk_size, chunk_sizes=CHUNK_SIZES)
    if reason is not None:
        return reason
    if q.ndim != 3 or v.ndim != 3:
        return "q, v: expected [T, H, K] and [T, HV, V]"
    head_k, head_v = q.shape[-1], v.shape[-1]
    for name, size in (("K", head_k), ("V", head_v)):
        if not _is_pow2(size) or not SUB <= size <= MAX_HEAD_DIM:
            return f"{name}: must be a power of two in [{SUB}, {MAX_HEAD_DIM}] for Triton tiles, got {size}"
    reason = kernel_dtype_reason(dict(q=q, k=k, v=v, g=g, beta=beta))
    if reason is not None:
        return reason
    for key in ("block_v", "output_block_v"):
        bv = tuning.get(key)
        if bv is not None and (not _is_pow2(bv) or not SUB <= bv <= head_v):
            return f"tuning: {key} must be a power of two in [{SUB}, V={head_v}], got {bv!r}"
    bk = tuning.get("kda_block_k")
    if bk is not None and (not _is_pow2(bk) or not SUB <= bk <= min(head_k, head_v)):
        return f"tuning: kda_block_k must be a power of two in [{SUB}, min(K, V)={min(head_k, head_v)}], got {bk!r}"
    if not interpret and not device.is_gpu():
        return f"backend: the Triton kernels need a GPU (or interpret=True), got {jax.default_backend()!r}"
    return None


_NT = ((1,), (1,))  # a @ b^T
_TN = ((0,), (0,))  # a^T @ b


def _pick_row(x, rows, r):
    """Row r of a register tile x [R, ...] (zeros when r is outside): tiles cannot be indexed dynamically."""
    sel = (rows == r).reshape(rows.shape + (1,) * (x.ndim - 1))
    return jnp.sum(jnp.where(sel, x, 0.0), axis=0)


def _decay(G_i, G_j, mask=None, *, channel):
    """exp(G_i - G_j) for the pairs selected by mask (0 elsewhere, masked before exp), G_i and G_j `Cumsum` tiles.

    channel=False: G_i [R], G_j [S] -> [R, S] (scalar decays, all pairs). channel=True: G_i and G_j broadcast
    against each other per key channel (e.g. [R, K] and [1, K]).
    """
    if not channel:
        G_i, G_j = G_i.map(lambda x: x[:, None]), G_j.map(lambda x: x[None, :])
    diff = G_i.gap(G_j)
    if mask is not None:
        diff = jnp.where(mask, diff, -jnp.inf)
    return _exp(diff)


def _doubling_inverse(A):
    """(I + A)^-1 of a strictly lower-triangular [SUB, SUB] tile by recursive doubling, no loop.

    With T_s the block-diagonal inverse on s-row blocks, T_2s = T_s - T_s A_s T_s, A_s = A restricted to the pairs
    (lower half, upper half) of each 2s-row block; T_2 = I - A_1 needs no product. IEEE fp32 dots (tiny tiles).
    """
    rows = jnp.arange(SUB, dtype=jnp.int32)
    T = jnp.where(rows[:, None] == rows[None, :], 1.0, 0.0) - jnp.where(_half_pairs(rows, 1), A, 0.0)
    for s in (2, 4, 8):
        A_s = jnp.where(_half_pairs(rows, s), A, 0.0)
        T = T - _ieee(T, _ieee(A_s, T))
    return T


def _write_wy(A, kb_blk, vb_blk, w_ref, u_ref, *, nb, dots):
    """T = (I + A)^-1 block by block (diagonal blocks by `_doubling_inverse`), then w = T (beta K), u = T (beta V)."""
    T = {}
    for I in range(nb):
        T[I, I] = _doubling_inverse(A[I, I])
        for J in range(I):
            acc = sum(dots.exact(A[I, m], T[m, J]) for m in range(J, I))
            T[I, J] = -dots.exact(T[I, I], acc)
        w_I = sum(dots.exact(T[I, J], kb_blk[J]) for J in range(I + 1))
        u_I = sum(dots.exact(T[I, J], vb_blk[J]) for J in range(I + 1))
        w_ref[pl.ds(I * SUB, SUB), :] = w_I.astype(w_ref.dtype)
        u_ref[pl.ds(I * SUB, SUB), :] = u_I.astype(u_ref.dtype)


def _ieee(a, b):
    return jax.lax.dot(a, b, precision=_HIGHEST, preferred_element_type=_F32)


def _half_pairs(rows, s):
    """[R, R] mask of the pairs (i, j) in one 2s-row block with i in its lower half and j in its upper half."""
    lower = rows % (2 * s) >= s
    same = (rows // (2 * s))[:, None] == (rows // (2 * s))[None, :]
    return same & lower[:, None] & ~lower[None, :]


def _diag_block_scores(lhs, k_I, G_I, G_rows, dots):
    """Exact per-channel scores sum_c a_ic k_jc exp(G_ic - G_jc), j < i, of one diagonal [SUB, SUB] block per a in lhs.

    Every strictly-lower pair lies in exactly one (lower half, upper half) quadrant of a 2s-row block, s in
    8, 4, 2, 1; there the reference-row factorisation exp(G_i - G_r) exp(G_r - G_j) with r the block's middle row has
    both factors <= 1 (g <= 0), so it is exact without any gate bound: one exp and one dot per level, no loop.
    G_rows(idx) gathers the rows idx [SUB] of G -> [SUB, K].
    """
    rows = jnp.arange(SUB, dtype=jnp.int32)
    outs = [jnp.zeros((SUB, SUB), _F32) for _ in lhs]
    for s in (8, 4, 2, 1):
        ref = rows // (2 * s) * (2 * s) + s
        lower = (rows % (2 * s) >= s)[:, None]
        G_r = G_rows(ref)  # [SUB, K]
        e = _exp(jnp.where(lower, G_I.gap(G_r), G_r.gap(G_I)))  # both exponents <= 0
        b = k_I * jnp.where(lower, 0.0, e)
        keep = _half_pairs(rows, s)
        outs = [o + jnp.where(keep, dots.exact(a * jnp.where(lower, e, 0.0), b, _NT), 0.0) for o, a in zip(outs, lhs)]
    return outs


def _intra_kernel_v2(start_ref, len_ref, q_ref, k_ref, v_ref, beta_ref, *refs, chunk, group, scale, split, dots):
    """GDN's intra pass (module docstring, step 2), grid (chunk, value head)."""
    refs = list(refs)
    G_ref = CumsumRefs.pop(refs, split)
    w_ref, u_ref, kd_ref, qg_ref, aqk_ref = refs
    c, h = pl.program_id(0), pl.program_id(1)
    hk = h // group
    start, length = start_ref[c], len_ref[c]
    head_k, head_v = k_ref.shape[-1], v_ref.shape[-1]
    nb = chunk // SUB
    sub_rows = jnp.arange(SUB, dtype=jnp.int32)
    G_last = G_ref[chunk - 1]  # padded rows have g = 0: the last real token's
    k_blk, q_blk, kb_blk, vb_blk, b_blk, G_blk = [], [], [], [], [], []
    for J in range(nb):
        rows = J * SUB + sub_rows
        mask = row_mask(rows, length, (SUB, head_k))
        k_J = plt.load(k_ref.at[pl.ds(start + J * SUB, SUB), hk, :], mask=mask, other=0)  # [SUB, K] input dtype
        q_J = plt.load(q_ref.at[pl.ds(start + J * SUB, SUB), hk, :], mask=mask, other=0)
        v_J = load_tokens(v_ref.at[pl.ds(start + J * SUB, SUB), h, :], rows, length, (SUB, head_v))
        b_J = load_tokens(beta_ref.at[pl.ds(start + J * SUB, SUB), h], rows, length, (SUB,))
        G_J = G_ref[pl.ds(J * SUB, SUB)]
        gamma = G_J.exp()[:, None]
        kf = k_J.astype(_F32)
        kd_ref[pl.ds(J * SUB, SUB), :] = (kf * _exp(G_last.gap(G_J))[:, None]).astype(kd_ref.dtype)
        qg_ref[pl.ds(J * SUB, SUB), :] = (scale * q_J.astype(_F32) * gamma).astype(qg_ref.dtype)
        k_blk.append(k_J)
        q_blk.append(q_J)
        b_blk.append(b_J)
        G_blk.append(G_J)
        kb_blk.append(b_J[:, None] * gamma * kf)
        vb_blk.append(b_J[:, None] * v_J)

    A = {}
    for I in range(nb):
        kk = dots.bulk(k_blk[I], k_blk[I], _NT) * _decay(G_blk[I], G_blk[I], sub_rows[:, None] > sub_rows[None, :],
                                                         channel=False)
        qk = dots.bulk(q_blk[I], k_blk[I], _NT) * _decay(G_blk[I], G_blk[I], sub_rows[:, None] >= sub_rows[None, :],
                                                         channel=False)
        A[I, I] = b_blk[I][:, None] * kk
        aqk_ref[pl.ds(I * SUB, SUB), pl.ds(I * SUB, SUB)] = (scale * qk).astype(aqk_ref.dtype)
        for J in range(I):
            decay = _decay(G_blk[I], G_blk[J], channel=False)
            kk = dots.bulk(k_blk[I], k_blk[J], _NT) * decay
            qk = dots.bulk(q_blk[I], k_blk[J], _NT) * decay
            A[I, J] = b_blk[I][:, None] * kk
            aqk_ref[pl.ds(I * SUB, SUB), pl.ds(J * SUB, SUB)] = (scale * qk).astype(aqk_ref.dtype)
        for J in range(I + 1, nb):
            aqk_ref[pl.ds(I * SUB, SUB), pl.ds(J * SUB, SUB)] = jnp.zeros((SUB, SUB), aqk_ref.dtype)

    _write_wy(A, kb_blk, vb_blk, w_ref, u_ref, nb=nb, dots=dots)


class _KdaChunk:
    """One chunk of one value head, as the KDA intra kernels read it: fp32 tiles of SUB token rows, K columns `cols`.

    Row block J (a Python int or a traced scalar) covers chunk rows [J * SUB, (J + 1) * SUB); token rows past the
    chunk's length load as zeros (so do their gates' increments: G stays flat there).
    """

    def __init__(self, start, length, q_ref, k_ref, v_ref, beta_ref, G_ref, *, h, group, block_k):
        self.start, self.length, self.h, self.hk, self.block_k = start, length, h, h // group, block_k
        self.q_ref, self.k_ref, self.v_ref, self.beta_ref, self.G_ref = q_ref, k_ref, v_ref, beta_ref, G_ref
        self.rows = jnp.arange(SUB, dtype=jnp.int32)

    def _tokens(self, ref_at, J, shape):
        return load_tokens(ref_at(pl.ds(self.start + J * SUB, SUB)), J * SUB + self.rows, self.length, shape)

    def key(self, J, cols):
        return self._tokens(lambda r: self.k_ref.at[r, self.hk, cols], J, (SUB, self.block_k))

    def query(self, J, cols):
        return self._tokens(lambda r: self.q_ref.at[r, self.hk, cols], J, (SUB, self.block_k))

    def value(self, J, cols):
        return self._tokens(lambda r: self.v_ref.at[r, self.h, cols], J, (SUB, self.block_k))

    def beta(self, J):
        return self._tokens(lambda r: self.beta_ref.at[r, self.h], J, (SUB,))[:, None]

    def gates(self, J, cols):
        return self.G_ref[pl.ds(J * SUB, SUB), cols]


def _kda_diag_scores(chunk, I, cols, k_I, q_I, G_I, *, dots):
    """Diagonal block I of the key and query scores over the columns `cols`, exact: (kk strictly lower, qk lower), by
    `_diag_block_scores` (4 levels, one exp of [SUB, BK] and two dots each)."""
    rows = chunk.rows
    G_rows = lambda idx: chunk.G_ref[I * SUB + idx, cols]
    kk, qk = _diag_block_scores([k_I, q_I], k_I, G_I, G_rows, dots)
    return kk, qk + jnp.where(rows[:, None] == rows[None, :], jnp.sum(q_I * k_I, axis=1)[:, None], 0.0)


def _kda_write_row_block(chunk, I, cols, k_I, q_I, G_I, kd_ref, qg_ref, *, last, scale):
    """Rows of row block I, columns `cols`, of KD = K exp(G_last - G) and QG = scale Q exp(G)."""
    G_last = chunk.G_ref[last, cols].map(lambda x: x[None, :])
    kd_ref[pl.ds(I * SUB, SUB), cols] = (k_I * _exp(G_last.gap(G_I))).astype(kd_ref.dtype)
    qg_ref[pl.ds(I * SUB, SUB), cols] = (scale * q_I * G_I.exp()).astype(qg_ref.dtype)


def _kda_solve_row_block(chunk, I, A, T, w_ref, u_ref, *, head_k, head_v, dots):
    """Row block I of T = (I + A)^-1 (into T) and of W = T (beta exp(G) K), U = T (beta V) (into w_ref, u_ref).

    A[J], J <= I: the beta-scaled score blocks of row block I; T holds the blocks of the earlier row blocks. The
    diagonal block by doubling, then T_IJ = -T_II sum_{J<=m<I} A_Im T_mJ; W and U per column block of the operands,
    (beta exp(G) K)_J and (beta V)_J loaded again for every row block rather than held.
    """
    T[I, I] = _doubling_inverse(A[I])
    for J in range(I):
        merged = sum(dots.exact(A[m], T[m, J]) for m in range(J, I))
        T[I, J] = -dots.exact(T[I, I], merged)
    betas = [chunk.beta(J) for J in range(I + 1)]
    block_k = chunk.block_k

    def w_step(kb, carry):
        cols = pl.ds(kb * block_k, block_k)
        w = sum(dots.exact(T[I, J], betas[J] * chunk.gates(J, cols).exp() * chunk.key(J, cols)) for J in range(I + 1))
        w_ref[pl.ds(I * SUB, SUB), cols] = w.astype(w_ref.dtype)
        return carry

    def u_step(vb, carry):
        cols = pl.ds(vb * block_k, block_k)
        u = sum(dots.exact(T[I, J], betas[J] * chunk.value(J, cols)) for J in range(I + 1))
        u_ref[pl.ds(I * SUB, SUB), cols] = u.astype(u_ref.dtype)
        return carry

    jax.lax.fori_loop(0, head_k // block_k, w_step, 0)
    jax.lax.fori_loop(0, head_v // block_k, u_step, 0)


def _kda_scores_kernel(start_ref, len_ref, q_ref, k_ref, beta_ref, *refs, chunk, group, scale, block_k, split, dots):
    """KDA's intra pass, launch A, grid (chunk, value head, row block I): its scores.

    Writes the beta-scaled key scores A_IJ (fp32, J <= I; the blocks above are never read), the query scores
    scale Aqk_IJ (zeros above the diagonal) and row block I of KD and QG. Per block J a loop over K column blocks
    accumulates one 16x16 pair of scores (rebased dot for J < I, `_kda_diag_scores` for J = I), so a program holds
    two [SUB, block_k] row tiles and two 16x16 accumulators: many small programs instead of one per chunk.
    """
    refs = list(refs)
    G_ref = CumsumRefs.pop(refs, split)
    akk_ref, aqk_ref, kd_ref, qg_ref = refs
    c, h, I = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_k = k_ref.shape[-1]
    ck = _KdaChunk(start_ref[c], len_ref[c], q_ref, k_ref, None, beta_ref, G_ref, h=h, group=group, block_k=block_k)
    zeros = jnp.zeros((SUB, SUB), _F32)
    b_I = ck.beta(I)
    block = lambda J: (pl.ds(I * SUB, SUB), pl.ds(J * SUB, SUB))
    columns = lambda step, init: jax.lax.fori_loop(0, head_k // block_k, step, init)

    def diag_step(kb, acc):
        cols = pl.ds(kb * block_k, block_k)
        k_I, q_I, G_I = ck.key(I, cols), ck.query(I, cols), ck.gates(I, cols)
        _kda_write_row_block(ck, I, cols, k_I, q_I, G_I, kd_ref, qg_ref, last=chunk - 1, scale=scale)
        kk, qk = _kda_diag_scores(ck, I, cols, k_I, q_I, G_I, dots=dots)
        return acc[0] + kk, acc[1] + qk

    kk, qk = columns(diag_step, (zeros, zeros))
    akk_ref[block(I)] = b_I * kk
    aqk_ref[block(I)] = (scale * qk).astype(aqk_ref.dtype)

    def off_diagonal(J, carry):
        def step(kb, acc):
            cols = pl.ds(kb * block_k, block_k)
            G_r = G_ref[I * SUB, cols].map(lambda x: x[None, :])  # the first row of block I: both factors <= 1
            to_r = _exp(ck.gates(I, cols).gap(G_r))
            b = ck.key(J, cols) * _exp(G_r.gap(ck.gates(J, cols)))
            return (acc[0] + dots.exact(ck.key(I, cols) * to_r, b, _NT),
                    acc[1] + dots.exact(ck.query(I, cols) * to_r, b, _NT))

        kk, qk = columns(step, (zeros, zeros))
        akk_ref[block(J)] = b_I * kk
        aqk_ref[block(J)] = (scale * qk).astype(aqk_ref.dtype)
        return carry

    def above(J, carry):
        aqk_ref[block(J)] = zeros.astype(aqk_ref.dtype)
        return carry

    jax.lax.fori_loop(0, I, off_diagonal, 0)
    jax.lax.fori_loop(I + 1, chunk // SUB, above, 0)


def _kda_solve_kernel(start_ref, len_ref, k_ref, v_ref, beta_ref, *refs, chunk, group, block_k, split, dots):
    """KDA's intra pass, launch B, grid (chunk, value head): T, W and U from the stored key scores."""
    refs = list(refs)
    G_ref = CumsumRefs.pop(refs, split)
    akk_ref, w_ref, u_ref = refs
    c, h = pl.program_id(0), pl.program_id(1)
    head_k, head_v = k_ref.shape[-1], v_ref.shape[-1]
    ck = _KdaChunk(start_ref[c], len_ref[c], None, k_ref, v_ref, beta_ref, G_ref, h=h, group=group, block_k=block_k)
    T = {}
    for I in range(chunk // SUB):
        A = [akk_ref[pl.ds(I * SUB, SUB), pl.ds(J * SUB, SUB)] for J in range(I + 1)]
        _kda_solve_row_block(ck, I, A, T, w_ref, u_ref, head_k=head_k, head_v=head_v, dots=dots)


def _state_kernel(*refs, chunk, channel, block_v, has_initial, has_checkpoints, fused, split, dots):
    refs = list(refs)
    take = lambda count: [refs.pop(0) for _ in range(count)]
    cu_ref, first_ref, count_ref = take(3)
    if has_checkpoints:
        seg_lo_ref, seg_hi_ref, seg_chunk_ref = take(3)
    G_ref = CumsumRefs.pop(refs, split)
    w_ref, u_ref, kd_ref = take(3)
    if fused:
        qg_ref, aqk_ref = take(2)
    init_ref = refs.pop(0) if has_initial else None
    if fused:
        o_ref, final_ref, ckpt_ref = refs
    else:
        h_ref, vnew_ref, final_ref, ckpt_ref = refs
    n, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)
    rows = jnp.arange(chunk, dtype=jnp.int32)
    head_k = kd_ref.shape[-1]
    row_start = cu_ref[n]
    row_len = cu_ref[n + 1] - row_start
    first = first_ref[n]
    if has_initial:
        S0 = init_ref[n, h, :, cols].astype(_F32)
    else:
        S0 = jnp.zeros((head_k, block_v), _F32)

    def chunk_step(i, S):
        # straight-line: branches and inner loops here would stop Triton pipelining the loop
        c = first + i
        start = row_start + i * chunk  # a row's chunks are contiguous: no per-chunk metadata load
        length = jnp.minimum(chunk, row_len - i * chunk)
        v_new = u_ref[h, c, :, cols].astype(_F32) - dots.exact(w_ref[h, c], S)  # [C, BV]
        if fused:
            o = dots.bulk(qg_ref[h, c], S) + dots.bulk(aqk_ref[h, c], v_new)
            plt.store(o_ref.at[pl.ds(start, chunk), h, cols], o.astype(o_ref.dtype),
                      mask=row_mask(rows, length, (chunk, block_v)))
        else:
            h_ref[h, c, :, cols] = S.astype(h_ref.dtype)
            vnew_ref[h, c, :, cols] = v_new.astype(vnew_ref.dtype)
        decay_last = G_ref[h, c, chunk - 1, :].exp()[:, None] if channel else G_ref[h, c, chunk - 1].exp()
        return decay_last * S + dots.exact(kd_ref[h, c], v_new, _TN)

    if not has_checkpoints:
        final_ref[n, h, :, cols] = jax.lax.fori_loop(0, count_ref[n], chunk_step, S0)
        return
    seg_hi = seg_hi_ref[n]

    def next_checkpoint_chunk(s):
        return jnp.where(s < seg_hi, seg_chunk_ref[s], -1)

    def step_storing_entries(i, carry):
        # the next checkpoint chunk rides in the carry, loaded one step ahead: the masked store's mask comes from
        # registers, so no step waits on a metadata load; `_checkpoint_kernel` finishes the export
        S, s, next_chunk = carry
        at_checkpoint = first + i == next_chunk
        slot = jnp.minimum(s, ckpt_ref.shape[0] - 1)  # past a row's last checkpoint the mask is off anyway
        plt.store(ckpt_ref.at[slot, h, :, cols], S, mask=jnp.broadcast_to(at_checkpoint, S.shape))
        s = s + at_checkpoint.astype(jnp.int32)
        return chunk_step(i, S), s, next_checkpoint_chunk(s)

    s0 = seg_lo_ref[n]
    S = jax.lax.fori_loop(0, count_ref[n], step_storing_entries, (S0, s0, next_checkpoint_chunk(s0)))[0]
    final_ref[n, h, :, cols] = S


def _checkpoint_kernel(valid_ref, ck_chunk_ref, ck_pos_ref, start_ref, len_ref, entry_slot_ref, k_ref, *refs, chunk,
                       group, channel, block_v, split, dots):
    """Grid (checkpoint, value head, V block): from the fp32 entry state S of the checkpoint's chunk (stored by the
    state pass at entry_slot, the chunk's rank among the distinct checkpoint chunks), v_new of the chunk again (the
    state pass's product) and the state after r tokens of it, exp(G_{r-1}) S + sum_{i<r} exp(G_{r-1} - G_i) k_i
    v_new_i^T in fp32 (r = 0 gives S exactly)."""
    refs = list(refs)
    G_ref = CumsumRefs.pop(refs, split)
    w_ref, u_ref, entry_ref, ckpt_ref = refs
    m, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)
    rows = jnp.arange(chunk, dtype=jnp.int32)

    @pl.when(valid_ref[m] != 0)  # padded CSR entries: nothing to export
    def _():
        c = ck_chunk_ref[m]
        S = entry_ref[entry_slot_ref[m], h, :, cols]
        v_new = u_ref[h, c, :, cols].astype(_F32) - dots.exact(w_ref[h, c], S)  # [C, BV]
        k_c = load_tokens(k_ref.at[pl.ds(start_ref[c], chunk), h // group, :], rows, len_ref[c],
                           (chunk, k_ref.shape[-1]))  # [C, K] fp32
        G_c = G_ref[h, c]
        r = ck_pos_ref[m]
        G_r = G_c.map(lambda x: _pick_row(x, rows, r - 1))  # r = 0: G_r = 0, no rows below: the state is S itself
        before = (rows < r)[:, None] if channel else rows < r
        if channel:
            k_r = k_c * _decay(G_r.map(lambda x: x[None, :]), G_c, before, channel=True)
            state = G_r.exp()[:, None] * S
        else:
            k_r = k_c * _exp(jnp.where(before, G_r.gap(G_c), -jnp.inf))[:, None]
            state = G_r.exp() * S
        ckpt_ref[m, h, :, cols] = state + dots.exact(k_r, v_new, _TN)


def _output_kernel(start_ref, len_ref, qg_ref, aqk_ref, h_ref, vnew_ref, o_ref, *, chunk, block_v, dots):
    c, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, length = start_ref[c], len_ref[c]
    rows = jnp.arange(chunk, dtype=jnp.int32)

    @pl.when(length > 0)
    def _():
        o = dots.bulk(qg_ref[...], h_ref[...]) + dots.bulk(aqk_ref[...], vnew_ref[...])
        plt.store(o_ref.at[pl.ds(start, chunk), h, pl.ds(j * block_v, block_v)], o.astype(o_ref.dtype),
                  mask=row_mask(rows, length, (chunk, block_v)))


def gdn_intra(chunk_start, chunk_len, q, k, v, beta, G, G_lo=None, *, chunk, group, scale, interpret=False,
              num_warps=4, num_stages=2):
    """GDN's intra pass (`_intra_kernel_v2`, module docstring step 2): W, U, KD, QG and AQK of every chunk.

    chunk_start, chunk_len  # i32[NC] from `jaxckpt.plan.layout.chunk_layout` (a row's chunks restart at its start)
    q, k                    # [T, H, K] in the I/O dtype (promote(k, v); fp32 if that is 32 bits or wider)
    v                       # [T, HV, V]
    beta                    # [T, HV]
    G                       # fp32 [HV, NC, C]: `gate_cumsum`
    G_lo                    # fp32 [HV, NC, C]: with G, `gate_cumsum(..., split=True)`'s pair; None: G is whole
    `group` = HV // H, `scale` a Python number. Returns (w [HV, NC, C, K], u [HV, NC, C, V], kd [HV, NC, C, K],
    qg [HV, NC, C, K], aqk [HV, NC, C, C]), chunk-major in the I/O dtype, padding rows zero.
    """
    io_dtype = intermediate_dtype(k, v)
    num_chunks, num_v_heads = chunk_start.shape[0], v.shape[1]
    widths = (k.shape[-1], v.shape[-1], k.shape[-1], k.shape[-1], chunk)
    full = pl.BlockSpec()
    gates = [G] if G_lo is None else [G, G_lo]
    return pl.pallas_call(
        functools.partial(_intra_kernel_v2, chunk=chunk, group=group, scale=scale, split=G_lo is not None,
                          dots=Dots(io_dtype)),
        out_shape=tuple(jax.ShapeDtypeStruct((num_v_heads, num_chunks, chunk, width), io_dtype) for width in widths),
        grid=(num_chunks, num_v_heads), in_specs=[full] * 6 + [gate_block(chunk, ())] * len(gates),
        out_specs=tuple(_chunk_block(chunk, width) for width in widths),
        compiler_params=plt.CompilerParams(num_stages=num_stages, num_warps=num_warps), interpret=interpret,
        name="delta_intra",
    )(chunk_start, chunk_len, q, k, v, beta, *gates)


def _chunk_block(chunk, width):
    return pl.BlockSpec((None, None, chunk, width), lambda c, h: (h, c, 0, 0))


def intra_v2(p: cumsum.Prepared, *, per_channel_decay, chunk_size, interpret, intra_num_warps=4, num_stages=2,
             kda_block_k=None):
    """The intra launch(es) of `delta_rule`: (w, u, kd, qg, aqk), chunk-major [HV, NC, C, K | V | C] in the io dtype."""
    cumsum.check_qk_normalized(p, reader="pallas_triton.intra_v2")
    head_k = p.q.shape[-1]
    num_v_heads, head_v = p.v.shape[1:]
    group = num_v_heads // p.q.shape[1]
    chunk = chunk_size
    starts = (p.lay.chunk_start, p.lay.chunk_len)
    if not per_channel_decay:
        return gdn_intra(*starts, p.q, p.k, p.v, p.beta, p.G, p.G_lo, chunk=chunk, group=group, scale=p.scale,
                         interpret=interpret, num_warps=intra_num_warps, num_stages=num_stages)
    num_chunks = p.lay.chunk_len.shape[0]
    full = pl.BlockSpec()
    params = plt.CompilerParams(num_stages=num_stages, num_warps=intra_num_warps)
    chunk_array = lambda width: jax.ShapeDtypeStruct((num_v_heads, num_chunks, chunk, width), p.io_dtype)
    gates = [p.G] if p.G_lo is None else [p.G, p.G_lo]
    kda_options = dict(chunk=chunk, group=group, block_k=kda_block_k or min(head_k, head_v, 32),
                       split=p.G_lo is not None, dots=Dots(p.io_dtype))
    by_row_block = lambda c, h, i: (h, c, 0, 0)
    akk, aqk, kd, qg = pl.pallas_call(
        functools.partial(_kda_scores_kernel, scale=p.scale, **kda_options),
        out_shape=(jax.ShapeDtypeStruct((num_v_heads, num_chunks, chunk, chunk), _F32), chunk_array(chunk),
                   chunk_array(head_k), chunk_array(head_k)),
        grid=(num_chunks, num_v_heads, chunk // SUB),
        in_specs=[full] * 5 + [pl.BlockSpec((None, None, chunk, head_k), by_row_block)] * len(gates),
        out_specs=tuple(pl.BlockSpec((None, None, chunk, width), by_row_block)
                        for width in (chunk, chunk, head_k, head_k)),
        compiler_params=params, interpret=interpret, name="delta_intra_scores",
    )(*starts, p.q, p.k, p.beta, *gates)
    w, u = pl.pallas_call(
        functools.partial(_kda_solve_kernel, **kda_options),
        out_shape=(chunk_array(head_k), chunk_array(head_v)),
        grid=(num_chunks, num_v_heads),
        in_specs=[full] * 5 + [gate_block(chunk, (head_k,))] * len(gates) + [_chunk_block(chunk, chunk)],
        out_specs=(_chunk_block(chunk, head_k), _chunk_block(chunk, head_v)),
        compiler_params=params, interpret=interpret, name="delta_intra_solve",
    )(*starts, p.k, p.v, p.beta, *gates, akk)
    return w, u, kd, qg, aqk


def delta_rule(q, k, v, g, beta, *, per_channel_decay, scale=None, use_qk_l2norm=False, initial_state=None,
               cu_seqlens=None, checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", chunk_size=64,
               interpret=False, num_warps=4, num_stages=2, block_v=None, intra_num_warps=4, output_block_v=None,
               fuse_output=False, kda_block_k=None):
    """The gated delta rule over packed varlen rows with checkpoint states, as four or five Pallas Triton launches.

    q, k                # [T, H, K]
    v                   # [T, HV, V]
    g                   # [T, HV] (GDN) or [T, HV, K] (KDA, `per_channel_decay`): log decay <= 0, any float dtype
    beta                # [T, HV]
    initial_state       # [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk"); None = zeros
    cu_seqlens          # i32[N + 1]; None = one row over all T tokens
    checkpoint_cu       # i32[N + 1] with checkpoint_offsets i32[M]; both None = no checkpoints
    Inputs are checked by the op wrappers; metadata values are trusted. `scale` is a Python number (None: K^-1/2).
    Tuning: num_warps / num_stages (state and output kernels), intra_num_warps, block_v (state pass V tile,
    default min(V, 64)), output_block_v (output kernel V tile, default min(V, 64)), fuse_output (the state pass
    writes O itself, three launches); KDA only: kda_block_k (the intra pass's K / V column block, default
    min(K, V, 32)).

    Returns (o [T, HV, V] in v.dtype, final_state fp32 [N, HV, K, V] / [N, HV, V, K],
    checkpoint_states fp32 [M, HV, K, V] / [M, HV, V, K]); padded checkpoint entries are unspecified.
    """
    num_tokens = q.shape[0]
    head_k = q.shape[-1]
    num_v_heads, head_v = v.shape[1:]
    group = num_v_heads // q.shape[1]
    chunk = chunk_size
    channel = per_channel_decay
    out_dtype = v.dtype
    block_v = block_v or min(head_v, 64)
    output_block_v = output_block_v or min(head_v, 64)
    p = cumsum.prepare(q, k, v, g, beta, per_channel_decay=channel, scale=scale, use_qk_l2norm=use_qk_l2norm,
                       cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                       chunk_size=chunk, interpret=interpret, intra_num_warps=intra_num_warps, num_stages=num_stages,
                       split_gates=True)
    q, k, v, beta, lay, io_dtype = p.q, p.k, p.v, p.beta, p.lay, p.io_dtype
    gates = [p.G] if p.G_lo is None else [p.G, p.G_lo]
    dots = Dots(io_dtype)
    num_rows = p.cu_seqlens.shape[0] - 1
    num_ckpt = lay.checkpoint_pos.shape[0]
    num_chunks = lay.chunk_len.shape[0]

    full = pl.BlockSpec()
    params = functools.partial(plt.CompilerParams, num_stages=num_stages)
    chunk_array = lambda width: jax.ShapeDtypeStruct((num_v_heads, num_chunks, chunk, width), io_dtype)
    init = None
    if initial_state is not None:
        init = initial_state.astype(_F32)
        init = init.swapaxes(-1, -2) if state_layout == "vk" else init
    kv = (head_k, head_v)
    final_shape = jax.ShapeDtypeStruct((num_rows, num_v_heads, *kv), _F32)
    ckpt_shape = jax.ShapeDtypeStruct((max(num_ckpt, 1), num_v_heads, *kv), _F32)
    o_shape = jax.ShapeDtypeStruct((q.shape[0], num_v_heads, head_v), out_dtype)
    state_grid = (num_rows, num_v_heads, head_v // block_v)
    bv = output_block_v

    w, u, kd, qg, aqk = intra_v2(p, per_channel_decay=channel, chunk_size=chunk, interpret=interpret,
                                 intra_num_warps=intra_num_warps, num_stages=num_stages, kda_block_k=kda_block_k)
    state_inputs = [p.cu_seqlens, lay.row_first_chunk, lay.row_num_chunks]
    if num_ckpt > 0:
        state_inputs += list(checkpoint_segments(lay, p.checkpoint_cu))
    state_inputs += [*gates, w, u, kd] + ([qg, aqk] if fuse_output else []) + ([init] if init is not None else [])
    seq_outputs = (o_shape,) if fuse_output else (
        jax.ShapeDtypeStruct((num_v_heads, num_chunks, *kv), io_dtype), chunk_array(head_v))
    *seq, final_state, checkpoint_states = pl.pallas_call(
        functools.partial(_state_kernel, chunk=chunk, channel=channel, block_v=block_v,
                          has_initial=init is not None, has_checkpoints=num_ckpt > 0, fused=fuse_output,
                          split=p.G_lo is not None, dots=dots),
        out_shape=(*seq_outputs, final_shape, ckpt_shape),
        grid=state_grid, in_specs=[full] * len(state_inputs), out_specs=(full,) * (len(seq_outputs) + 2),
        compiler_params=params(num_warps=num_warps), interpret=interpret, name="delta_state",
    )(*state_inputs)
    if num_ckpt > 0:
        checkpoint_states = pl.pallas_call(
            functools.partial(_checkpoint_kernel, chunk=chunk, group=group, channel=channel,
                              block_v=block_v, split=p.G_lo is not None, dots=dots),
            out_shape=ckpt_shape, grid=(num_ckpt, num_v_heads, head_v // block_v), in_specs=[full] * (10 + len(gates)),
            out_specs=full, compiler_params=params(num_warps=num_warps), interpret=interpret,
            name="delta_checkpoints",
        )(lay.checkpoint_valid.astype(jnp.int32), lay.checkpoint_chunk, lay.checkpoint_pos, lay.chunk_start,
          lay.chunk_len, checkpoint_chunk_ranks(lay), k, *gates, w, u, checkpoint_states)
    if fuse_output:
        (o,) = seq
    else:
        h_states, v_new = seq
        o = pl.pallas_call(
            functools.partial(_output_kernel, chunk=chunk, block_v=bv, dots=dots),
            out_shape=o_shape, grid=(num_chunks, num_v_heads, head_v // bv),
            in_specs=[full, full,
                      pl.BlockSpec((None, None, chunk, head_k), lambda c, h, j: (h, c, 0, 0)),
                      pl.BlockSpec((None, None, chunk, chunk), lambda c, h, j: (h, c, 0, 0)),
                      pl.BlockSpec((None, None, head_k, bv), lambda c, h, j: (h, c, 0, j)),
                      pl.BlockSpec((None, None, chunk, bv), lambda c, h, j: (h, c, 0, j))],
            out_specs=full,
            compiler_params=params(num_warps=num_warps), interpret=interpret, name="delta_output",
        )(lay.chunk_start, lay.chunk_len, qg, aqk, h_states, v_new)

    # tokens past cu_seqlens[-1] and padded CSR entries are never written: zero them rather than leak garbage
    o = jnp.where(lay.token_valid[:, None, None], o, 0)[:num_tokens]
    checkpoint_states = jnp.where(lay.checkpoint_valid[:, None, None, None], checkpoint_states[:num_ckpt], 0)
    if state_layout == "vk":
        final_state, checkpoint_states = final_state.swapaxes(-1, -2), checkpoint_states.swapaxes(-1, -2)
    return o, final_state, checkpoint_states


gated_delta_rule, kda = kernel_entries(delta_rule, supports, TUNING_KEYS,
                                       inputs="q, k, v in fp32, bf16 or f16, K and V powers of two in [16, 256]; "
                                              "`chunk_size` in (16, 32, 64)",
                                       config="jaxckpt.ops.DeltaPallasTritonConfig")
