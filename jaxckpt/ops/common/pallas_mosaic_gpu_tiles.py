"""Pieces shared by the Pallas Mosaic GPU kernels (the intra passes `delta_rule.pallas_mosaic_gpu.intra` for GDN and
`delta_rule.pallas_mosaic_gpu.kda_intra` for KDA, the state passes `delta_rule.pallas_mosaic_gpu.pipeline`,
`delta_rule.pallas_mosaic_gpu.state`, `delta_rule.pallas_mosaic_gpu.gdn_fused`, and SSD's
`jaxckpt.ops.ssd.pallas_mosaic_gpu`): SMEM tile layouts, WGMMA-layout index helpers, hi + lo operand splits, the wgmma
product sums, the TMA ring's producer loop and the stores of an output into the packed token layout (`token_staging`,
`store_rows`, `store_zeros`), the fp32 inverses of a tile's 16 x 16 diagonal blocks by forward substitution
(`block_diagonal_inverse`, for the intra passes' "blocked" inverse) and rows read across a warp by shuffles
(`reference_rows`, for the KDA score levels). Written against jax 0.11.2."""

from __future__ import annotations

import functools
from types import SimpleNamespace

# Pallas defines one config flag lazily, the first time it lowers a kernel (the fuser's, imported by einshape); the
# new flag changes jit's tracing context, so a process's first jitted call would compile twice. Importing it here
# defines it before anything is traced.
import jax.experimental.pallas.fuser  # noqa: F401
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, nvvm, vector
from jaxlib.mlir.dialects import math as mlir_math

from jaxckpt.ops.common.contract import kernel_dtype_reason

CHUNK = 64  # wgmma's M: one chunk is one accumulator tile
HEAD_DIMS = (64, 128)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # wgmma's 16-bit operands
F32 = jnp.float32
WG = plgpu.Layout.WGMMA


def swizzled(shape, dtype):
    """SMEM tiled (8, swizzle / itemsize) and swizzled: as wgmma operands need, and conflict-free register stores."""
    dtype = jnp.dtype(dtype)
    swizzle = plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // dtype.itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))


def token_staging(shape, dtype):
    """One SMEM staging tile [C, 64] (16-bit) for an output that leaves in the packed token layout, as a
    `plgpu.RefUnion` of three views of the same bytes: (untiled 128-byte-swizzled, the TMA source of a whole chunk at
    any GMEM row; tiled and swizzled, what WGMMA-layout registers are stored through; plain, the source of
    `store_rows`). For 64 two-byte columns (one 128-byte swizzle row) the first two are the same layout (checked on the
    H200, `bench/results/mosaic_gpu_refunion_probe_h200.log`), so a chunk is stored through the tiled view and leaves
    through the untiled one; a TMA from a *tiled* view at a GMEM row off the 8-row grid drops rows on the GPU. The plain
    view is written only for a partial chunk, never read through another view. Mosaic GPU's interpreter keeps the views
    apart (no aliasing), so under `interpret` a whole chunk leaves through the tiled view (the interpreter copies any
    rows)."""
    if shape[-1] * jnp.dtype(dtype).itemsize != 128:
        raise ValueError(f"shape: token staging needs 128-byte rows (64 16-bit columns), got {shape} of {dtype}")
    return plgpu.RefUnion(plgpu.SMEM(shape, dtype, transforms=(plgpu.SwizzleTransform(128),)), swizzled(shape, dtype),
                          plgpu.SMEM(shape, dtype))


def load(ref, layout=WG):
    return plgpu.load(ref, layout=layout, optimized=False)


def iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WG)


def by_row(vec, shape):
    return lax.broadcast_in_dim(vec, shape, [0])


def by_col(vec, shape):
    return lax.broadcast_in_dim(vec, shape, [1])


def key_scales(r2):
    """(d, 1 / d) per row, fp32, from the keys' squared norms r2: powers of two within a factor sqrt(2) of |k|
    (exactly 1 for |k|^2 in [0.5, 2), and for zero keys and padding rows), clamped to 2^+-30. The intra passes invert
    D (I + A) D^-1 = I + D A D^-1, whose entries beta_i (k_i . k_j) e^(G_i - G_j) d_i / d_j are at most
    2 beta_i |k_i|^2 whatever the keys' norms, and map back exactly: T = D^-1 T' D
    (`delta_rule.pallas_mosaic_gpu.intra`, "Range")."""
    n = lax.round(0.5 * jnp.log2(jnp.maximum(r2, 2.0 ** -126)), lax.RoundingMethod.TO_NEAREST_EVEN)
    n = jnp.where(r2 > 0, jnp.clip(n, -30.0, 30.0), 0.0)
    return jnp.exp2(n), jnp.exp2(-n)


def as_cols(vec, n):
    """A per-row vector [n] (WGMMA row layout) in the column layout: the column sums of its diagonal matrix, exact."""
    sq = (n, n)
    return jnp.sum(jnp.where(iota(sq, 0) == iota(sq, 1), by_row(vec, sq), 0.0), axis=0)


def split(x, dtype, parts):
    """x (fp32) as `parts` terms of `dtype`: (x,) rounded, or (hi, lo) with hi + lo = x to ~2^-17 relative."""
    hi = x.astype(dtype)
    return (hi,) if parts == 1 else (hi, (x - hi.astype(F32)).astype(dtype))


def store_parts(buf, x, parts):
    for p, part in enumerate(split(x, buf.dtype, parts)):
        buf.at[p][...] = part


def dots(*products):
    """For each (lhs, rhs, shape): sum of lhs[i] @ rhs[j] over i + j < 2 (hi.hi, hi.lo, lo.hi of split operands).

    wgmma with fp32 accumulation; lhs and rhs terms are SMEM refs (the interpreter takes no register operands).
    Independent products are all issued before the first wait. Reading an accumulator waits for the wgmmas; the
    optimization barrier keeps later arithmetic from being scheduled before that wait (jla saw stale, silently
    zero results without it on sm_90 with jax 0.11.2).
    """
    def body(*accs):
        for acc, (lhs, rhs, _) in zip(accs, products):
            for i, a in enumerate(lhs):
                for j, b in enumerate(rhs):
                    if i + j < 2:
                        plgpu.wgmma(acc, a, b)
        return tuple(acc[...] for acc in accs)

    return lax.optimization_barrier(pl.run_scoped(body, *(plgpu.ACC(shape, F32) for *_, shape in products)))


def lhs(x, detour):
    """x (16-bit registers) as a wgmma A operand; under the interpreter (`detour` a scratch tile) through SMEM, the
    only A operand Mosaic GPU's interpreter reads (jax 0.11.2)."""
    if detour is None:
        return x
    detour[...] = x
    plgpu.commit_smem()
    return detour


def matmuls(*products, during=None):
    """For each (shape, pairs): sum(a @ b for a, b in pairs) on the tensor cores into its own fp32 accumulator, every
    wgmma issued before the first read; `during()` runs between the issue and the reads, overlapping the wgmmas, and
    what it returns, unless None, comes back after the accumulators.

    The optimization barrier keeps arithmetic on the results after the accumulator reads: their wgmma wait has no
    data dependency on the registers, so LLVM could otherwise move uses of stale registers before it.
    """
    def scoped(*accs):
        for acc, (_, pairs) in zip(accs, products):
            for a, b in pairs:
                plgpu.wgmma(acc, a, b)
        extra = None if during is None else during()
        return tuple(acc[...] for acc in accs) + (() if extra is None else (extra,))

    return lax.optimization_barrier(pl.run_scoped(scoped, *(plgpu.ACC(shape, F32) for shape, _ in products)))


def matmul(shape, pairs, during=None):
    return matmuls((shape, pairs), during=during)[0]


def store_rows(rows_s, dst, start, length):
    """Rows [0, length) of the plain (untiled, unswizzled) SMEM tile rows_s [R, W] to the GMEM rows [start, start +
    length) of dst [T, W], for R a power of two and 0 <= length < R: one TMA box per set bit of length (R / 2, ...,
    1 rows).

    Why boxes: a TMA store cannot be masked by rows, and the rows past `length` belong to the next row of tokens or
    to padding. Why a plain tile: the boxes start at any of its rows, with no tiling or swizzle atom to line up with.
    A start off dst's 8-row grid is fine (dst is not tiled)."""
    offset = 0
    bit = rows_s.shape[0] // 2
    while bit:
        @pl.when(lax.bitwise_and(length, bit) != 0)
        def _():
            plgpu.copy_smem_to_gmem(rows_s.at[pl.ds(offset, bit)], dst.at[pl.ds(start + offset, bit)])

        offset = offset + lax.bitwise_and(length, bit)
        bit //= 2


def padding_lane(lane_first, lane_count, chunk_start, chunk_len, num_tokens):
    """The lanes of a kernel whose output leaves in the packed token layout, plus one extra, empty lane whose CTAs
    write zeros over the tokens past the last lane's last chunk (a packed call's padding) with `store_zeros`. The
    extra lane has no start state nor end state of its own: the kernels read the last real lane's start state for it
    (`lane_state`) and skip its end-state store (`real_lanes`), so no state array is padded or sliced around the
    call.

    lane_first, lane_count  # i32[L]
    chunk_start, chunk_len  # i32[NC]
    Returns (lane_first, lane_count i32[L + 1], pad i32[2] = (first padding token, number of padding tokens)); the
    extra lane is the last grid lane."""
    lane_first, lane_count = lane_first.astype(jnp.int32), lane_count.astype(jnp.int32)
    last = jnp.maximum(lane_first + lane_count - 1, 0)
    ends = jnp.where(lane_count > 0, chunk_start[last] + chunk_len[last], 0)
    pad_start = jnp.max(ends, initial=0).astype(jnp.int32)
    lane_first, lane_count = (jnp.concatenate([x, jnp.zeros(1, jnp.int32)]) for x in (lane_first, lane_count))
    return lane_first, lane_count, jnp.stack([pad_start, num_tokens - pad_start]).astype(jnp.int32)


def lane_state(lane, pad_lane):
    """The index of grid lane `lane`'s start state: the padding lane (`padding_lane`; None: the grid has none) reads
    the last real lane's, a load its zero chunks never use."""
    return lane if pad_lane is None else jnp.minimum(lane, pad_lane - 1)


def real_lanes(lane, pad_lane):
    """A decorator running its body on every grid lane but the padding lane (`padding_lane`; None: the grid has
    none), where an end state is stored."""
    return (lambda body: body()) if pad_lane is None else pl.when(lane != pad_lane)


def store_chunk(value, tiled, whole, rows_s, dst, start, length):
    """One chunk's output rows `value` (WGMMA-layout registers [C, W]) to the GMEM rows [start, start + length) of dst
    [T, W]: a full chunk is stored through `tiled` and leaves from `whole` (the staging tile's tiled and untiled
    views, `token_staging`; under `interpret` both the tiled view) as one box; a row's last, partial chunk goes through
    the plain tile rows_s and leaves as `store_rows` boxes. It first waits for the previous chunk's stores to have
    read these tiles."""
    chunk = tiled.shape[0]
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(length == chunk)
    def _():
        tiled[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(whole, dst.at[pl.ds(start, chunk)])

    @pl.when(length < chunk)  # rows past length are the next row's tokens or padding
    def _():
        rows_s[...] = value
        plgpu.commit_smem()
        store_rows(rows_s, dst, start, length)


def token_output(chunk_output, *, first, count, chunk_start, chunk_len, tiled, whole, rows_s, dst, pad, pad_lane):
    """An output warpgroup's loop over its lane's chunks first, ..., first + count - 1, writing the packed token
    layout: chunk_output(i, length) gives chunk first + i's output rows (WGMMA-layout registers, 16-bit), stored with
    `store_chunk` through the staging views (tiled, whole, rows_s) at the chunk's tokens of dst [T, W]; the chunk
    table entries of the next chunk are loaded before each chunk's work, which hides them. On the extra lane of
    `padding_lane` (`pad_lane` true) the padding tokens pad = (start, length) get zeros. Waits for every store."""
    num_chunks = chunk_start.shape[0]

    def ahead(c):
        c = jnp.minimum(c, num_chunks - 1)
        return chunk_start[c], chunk_len[c]

    def step(i, carry):
        start, length = carry
        after = ahead(first + i + 1)
        store_chunk(chunk_output(i, length), tiled, whole, rows_s, dst, start, length)
        return after

    lax.fori_loop(0, count, step, ahead(first))

    @pl.when(pad_lane)
    def _():
        store_zeros(rows_s, dst, pad[0], pad[1])

    plgpu.wait_smem_to_gmem(0)


def store_zeros(rows_s, dst, start, length):
    """Zeros over the GMEM rows [start, start + length) of dst [T, W] (any length), from the plain SMEM tile rows_s
    [R, W] (overwritten with zeros): whole boxes of R rows, then `store_rows` for the rest. The caller waits for the
    stores (`plgpu.wait_smem_to_gmem`) before the CTA ends."""
    height = rows_s.shape[0]
    rows_s[...] = plgpu.layout_cast(jnp.zeros(rows_s.shape, rows_s.dtype), WG)
    plgpu.commit_smem()

    def whole(i, carry):
        plgpu.copy_smem_to_gmem(rows_s, dst.at[pl.ds(start + i * height, height)])
        return carry

    lax.fori_loop(0, lax.div(length, height), whole, 0)
    rest = lax.rem(length, height)
    store_rows(rows_s, dst, start + length - rest, rest)


def landing_pieces(tile):
    """A landing tile's TMA boxes: the whole [C, N] row-major tile, or each 128-byte column piece of a swizzled one."""
    return [tile] if tile.ndim == 2 else [tile.at[j] for j in range(tile.shape[0])]


def land(src, tile, bar):
    """TMA of src (GMEM [C, N]) into its landing tile, one box per piece."""
    for j, piece in enumerate(landing_pieces(tile)):
        width = piece.shape[-1]
        plgpu.copy_gmem_to_smem(src.at[:, pl.ds(j * width, width)], piece, bar)


def landed_tokens(tile, length):
    """The landing tile's rows as fp32 [C, N], rows past the chunk's length zero (`where`: NaN padding stays out)."""
    x = jnp.concatenate([plgpu.load(piece, layout=WG) for piece in landing_pieces(tile)], axis=1).astype(jnp.float32)
    return jnp.where(iota(x.shape, 0) < length, x, 0.0)


def store_in_place(tile, x, dst):
    """x [C, N] -> dst (GMEM) through its (consumed) landing tile, piece by piece."""
    for j, piece in enumerate(landing_pieces(tile)):
        width = piece.shape[-1]
        piece[...] = x[:, j * width:(j + 1) * width].astype(piece.dtype)
    plgpu.commit_smem()
    for j, piece in enumerate(landing_pieces(tile)):
        width = piece.shape[-1]
        plgpu.copy_smem_to_gmem(piece, dst.at[:, pl.ds(j * width, width)])


def half_pairs(s):
    """[C, C] mask of the pairs (i, j) in one 2s-row block with i in its lower half and j in its upper half."""
    rows, cols = iota((CHUNK, CHUNK), 0), iota((CHUNK, CHUNK), 1)
    same = lax.div(rows, 2 * s) == lax.div(cols, 2 * s)
    return same & (lax.rem(rows, 2 * s) >= s) & (lax.rem(cols, 2 * s) < s)


BLOCK = 16  # the diagonal blocks `block_diagonal_inverse` solves by substitution
# fp32 row pitch of the substitution's SMEM tile: 72 words put the 8 rows of a WGMMA-layout access 8 banks apart
# (64 words would put them on the same banks: 8-way conflicts)
PAD_ROW = CHUNK + 8


def substitution_pad():
    """The plain fp32 SMEM tile [C, C + 8] `block_diagonal_inverse` works in (18 KB)."""
    return plgpu.SMEM((CHUNK, PAD_ROW), F32)


def substitute_column(x, neg_a, fma):
    """Forward substitution for one column of (I + A_b)^-1, A_b a strictly lower [B, B] block: x (B values) enters
    as the column e_j and leaves as T_b e_j, updated in place by x_i = fma(-A_b[i, m], x_m, x_i) for m = 0, ..., B - 2
    and i > m (x_m is final once step m starts). neg_a(i, m) gives -A_b[i, m]. Written once for the kernel (MLIR
    values, `fma` = math.fma) and the tests (numpy float32)."""
    for m in range(len(x) - 1):
        for i in range(m + 1, len(x)):
            x[i] = fma(neg_a(i, m), x[m], x[i])
    return x


@plgpu.inline_mgpu(arg_types=(WG, plgpu.RefType()),
                   return_type=plgpu.ShapeDtypeStruct((CHUNK, CHUNK), F32, layout=WG))
def _substitute(ctx, neg_A, pad):
    """-A (WGMMA layout) -> the tile whose 16 x 16 diagonal blocks hold (I + A_b)^-1 (other entries: -A's)."""
    del ctx
    f32, index, i32 = ir.F32Type.get(), ir.IndexType.get(), ir.IntegerType.get_signless(32)
    tile = mgpu_utils.memref_slice(pad, (slice(None), slice(0, CHUNK)))  # rows PAD_ROW apart
    neg_A.store_untiled(tile)
    mgpu_utils.warpgroup_barrier()
    # thread t solves column t % 16 of diagonal block (t % 64) // 16 in registers; the two blocks of a warp read one
    # address each per load (a broadcast, on distinct banks). Threads 64..127 repeat 0..63 (the barriers below take
    # the whole warpgroup) and store nothing
    tid = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(mgpu_utils.WARPGROUP_SIZE, i32))
    j = arith.remui(tid, mgpu_utils.c(BLOCK, i32))
    base = arith.index_cast(index, arith.subi(arith.remui(tid, mgpu_utils.c(CHUNK, i32)), j))
    at = lambda i: arith.addi(base, mgpu_utils.c(i, index))
    one, zero = mgpu_utils.c(1.0, f32), mgpu_utils.c(0.0, f32)
    x = [arith.select(arith.cmpi(arith.CmpIPredicate.eq, j, mgpu_utils.c(i, i32)), one, zero) for i in range(BLOCK)]
    x = substitute_column(x, lambda i, m: memref.load(tile, [at(i), at(m)]), mlir_math.fma)
    mgpu_utils.warpgroup_barrier()  # every thread has read its A entries before the blocks' T overwrites them
    # a warp's store covers one row's 32 columns: no conflicts
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, tid, mgpu_utils.c(CHUNK, i32))):
        col = arith.addi(base, arith.index_cast(index, j))
        for i in range(BLOCK):
            memref.store(x[i], tile, [at(i), col])
    mgpu_utils.warpgroup_barrier()
    T = mgpu.FragmentedArray.load_untiled(tile, layout=neg_A.layout)
    # the caller's next SMEM writes may land on these bytes (a RefUnion): every thread has its T first
    mgpu_utils.warpgroup_barrier()
    return T


def reference_source(lane, log_s, xp):
    """Where a thread finds its rows' reference rows r(i) = (i & -2s) + s (s = 2^log_s <= 8, i its row in its warp's
    16) in the WGMMA layout, where lane l holds rows l >> 2 (top register half) and (l >> 2) + 8 (bottom half) at
    columns 2 (l & 3) + 8 m + {0, 1}: the source lane (same columns), and nonzero where the top row's r lies in the
    bottom half (s = 8; the bottom row's always does). Written once for the kernel (`xp`: MLIR i32 values) and the
    tests (numpy)."""
    block = xp.add(log_s, 1)
    r = xp.add(xp.left_shift(xp.right_shift(xp.right_shift(lane, 2), block), block), xp.left_shift(1, log_s))
    src = xp.add(xp.left_shift(xp.bitwise_and(r, 7), 2), xp.bitwise_and(lane, 3))
    return src, xp.right_shift(r, 3)


def _i32(x):
    return x if isinstance(x, ir.Value) else mgpu_utils.c(x, ir.IntegerType.get_signless(32))


_ARITH = SimpleNamespace(add=lambda a, b: arith.addi(_i32(a), _i32(b)),
                         bitwise_and=lambda a, b: arith.andi(_i32(a), _i32(b)),
                         left_shift=lambda a, b: arith.shli(_i32(a), _i32(b)),
                         right_shift=lambda a, b: arith.shrui(_i32(a), _i32(b)))


def _shuffle_idx(reg, src):
    """reg (a vector of 32-bit values) as held by lane src, one `shfl.sync.idx` per element."""
    i32 = ir.IntegerType.get_signless(32)
    out = reg
    for e in range(ir.VectorType(reg.type).shape[0]):
        at = ir.DenseI64ArrayAttr.get([e])
        word = mgpu_utils.bitcast(vector.extract(reg, dynamic_position=[], static_position=at), i32)
        word = nvvm.shfl_sync(_i32(-1), word, src, _i32(0x1F), nvvm.ShflKind.idx)
        out = vector.insert(mgpu_utils.bitcast(word, ir.VectorType(reg.type).element_type), out,
                            dynamic_position=[], static_position=at)
    return out


@functools.cache
def _reference_rows_fn(shape):
    @plgpu.inline_mgpu(arg_types=(WG, WG), return_type=plgpu.ShapeDtypeStruct(shape, F32, layout=WG))
    def shuffle(ctx, x, log_s):
        del ctx
        first = log_s.registers.flat[0]
        log_s = vector.extract(first, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
        lane = arith.remui(mgpu_utils.thread_idx(), _i32(mgpu_utils.WARP_SIZE))
        src, top_reads_bottom = reference_source(lane, log_s, _ARITH)
        top_reads_bottom = arith.cmpi(arith.CmpIPredicate.ne, top_reads_bottom, _i32(0))
        regs = x.registers
        out = np.empty_like(regs)
        for idx in np.ndindex(regs.shape):
            if idx[4]:  # the register half (WGMMA layout: registers [1, N / 8, 1, 1, 2, 1, 1, 1, 1])
                out[idx] = _shuffle_idx(regs[idx], src)
            else:
                bottom = regs[idx[:4] + (1,) + idx[5:]]
                out[idx] = _shuffle_idx(arith.select(top_reads_bottom, bottom, regs[idx]), src)
        return mgpu.FragmentedArray(_registers=out, _layout=x.layout, _is_signed=None)

    return shuffle


def reference_rows(x, log_s):
    """R with row i = x's row (i & -2s) + s, s = 2^log_s <= 8 (traced int32), of an fp32 [C, N] WGMMA-layout tile:
    such a row lies in row i's warp, so two warp shuffles per register pair fetch it (`reference_source`), the KDA
    score levels' reference rows (`delta_rule.pallas_mosaic_gpu.kda_intra`, step 2) without select chains. Mosaic GPU
    code (`inline_mgpu`), which Mosaic GPU's interpreter cannot run (jax 0.11.2)."""
    # inline_mgpu takes arrays with a layout, not scalars: the level rides in as a constant tile (one register read)
    return _reference_rows_fn(x.shape)(x, plgpu.layout_cast(jnp.full(x.shape, log_s, jnp.int32), WG))


def block_diagonal_inverse(A, pad):
    """The block-diagonal T_16 whose 16 x 16 diagonal blocks are (I + A_b)^-1 of a strictly lower fp32 [C, C] tile A
    (WGMMA layout), exact in fp32: forward substitution, one column per thread (`substitute_column`), in the plain
    fp32 SMEM tile pad (`substitution_pad`; its bytes are free again on return). Mosaic GPU code (`inline_mgpu`),
    which Mosaic GPU's interpreter cannot run (jax 0.11.2)."""
    T = _substitute(-A, pad)
    rows, cols = iota((CHUNK, CHUNK), 0), iota((CHUNK, CHUNK), 1)
    return jnp.where(lax.div(rows, BLOCK) == lax.div(cols, BLOCK), T, 0.0)


def fill_ring(first, count, stages, in_free, issue, *, on_free=None):
    """The memory warpgroup's loop of a warp-specialized lane kernel: for the lane's chunks c = first + i, wait until
    slot i % stages is free again (`in_free`: its consumers are done with chunk i - stages), then `issue(c, slot)`
    its TMA copies; at the end observe the last frees too (every completed barrier phase must have a waiter: the
    interpreter checks it when the barrier goes away). `on_free(i)`, when given, runs right after each wait for the
    lane's chunk i (in the refill and the final waits alike), for copies outside the ring that reuse what chunk i's
    consumers released (SSD's z tiles)."""
    def freed(i):
        plgpu.barrier_wait(in_free.at[lax.rem(i, stages)])
        if on_free is not None:
            on_free(i)

    def refill(i, carry):
        @pl.when(i >= stages)
        def _():
            freed(i - stages)

        issue(first + i, lax.rem(i, stages))
        return carry

    lax.fori_loop(0, count, refill, 0)

    def drain(i, carry):
        freed(i)
        return carry

    lax.fori_loop(jnp.maximum(count - stages, 0), count, drain, 0)


SMEM_BYTES = 227 * 1024  # per CTA on sm_90


def ring_depth(per_stage, fixed, *, stages=None, what=""):
    """`stages`, or the deepest TMA ring (4, 3, then 2 slots of `per_stage` bytes) that fits in SMEM beside `fixed`
    bytes; ValueError naming `what` (the kernel's shape) when not even the asked or smallest ring fits."""
    for depth in (4, 3, 2) if stages is None else (stages,):
        if depth * per_stage + fixed <= SMEM_BYTES:
            return depth
    depth = stages or 2
    raise ValueError(f"stages: {depth} TMA slots {what} need {depth * per_stage + fixed} bytes of SMEM, more than "
                     f"{SMEM_BYTES}")


def interpret_params(interpret):
    if interpret is True:
        return plgpu.InterpretGPUParams()
    return interpret or None


def io_dtype(k, v):
    io_dtype = jnp.promote_types(k.dtype, v.dtype)
    return jnp.dtype(F32) if io_dtype.itemsize >= 4 else io_dtype


def input_reason(q, k, v, beta, G, *, chunk, tuning, tuning_keys, G_shape) -> str | None:
    """The first reason an intra kernel cannot take these inputs (the checks both intra kernels share), else None."""
    unknown = sorted(set(tuning) - set(tuning_keys))
    if unknown:
        return f"tuning: unknown options {unknown}, expected some of {tuning_keys}"
    if chunk != CHUNK:
        return f"chunk: must be {CHUNK} (wgmma tiles have 64 rows), got {chunk!r}"
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or beta.ndim != 2 or G.ndim != len(G_shape.split(",")):
        return f"q, k, v, beta, G: expected [T, H, K], [T, H, K], [T, HV, V], [T, HV], [{G_shape}]"
    if v.shape[1] % q.shape[1]:
        return f"v: value heads ({v.shape[1]}) must be a multiple of key heads ({q.shape[1]})"
    for name, size in (("K", q.shape[-1]), ("V", v.shape[-1])):
        if size not in HEAD_DIMS:
            return f"{name}: must be one of {HEAD_DIMS} on this backend, got {size}"
    return kernel_dtype_reason(dict(q=q, k=k, v=v, beta=beta))


def wgmma_reason(dims: dict, operands: dict, *, fallback: str = "") -> str | None:
    """None when every named size is in HEAD_DIMS and the named operands share one 16-bit dtype (the wgmma tiles'
    rules), else the reason; `fallback` closes the dtype reason (where such inputs go instead)."""
    for name, size in dims.items():
        if size not in HEAD_DIMS:
            return f"{name}: must be one of {HEAD_DIMS} for the wgmma tiles, got {size}"
    dtypes = [x.dtype for x in operands.values()]
    if dtypes[0] not in DTYPES or any(d != dtypes[0] for d in dtypes):
        return (f"{', '.join(operands)}: one 16-bit dtype (bfloat16 or float16) for the wgmma operands, got "
                f"{', '.join(map(str, dtypes))}{fallback}")
    return None


def chunk_major_beta(chunk_start, chunk_len, beta, *, chunk):
    """fp32 [HV, NC, C]: beta per chunk with padding rows 0 (a [T, HV] column is strided, which TMA cannot read)."""
    pos = jnp.arange(chunk, dtype=jnp.int32)
    token = jnp.clip(chunk_start[:, None] + pos, 0, beta.shape[0] - 1)  # i32[NC, C]
    beta_c = jnp.where((pos < chunk_len[:, None])[..., None], beta[token].astype(F32), 0.0)  # [NC, C, HV]
    return beta_c.transpose(2, 0, 1)
