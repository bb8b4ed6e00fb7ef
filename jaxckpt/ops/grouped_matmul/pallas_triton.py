"""Grouped matmul as Pallas kernels for the Triton lowering; the algorithm and the tile table are in README.md.

Forward: one launch over (N block, row tile). The row tiles come from `tile_table` (jnp, traceable, no host sync):
each group's rows split into `block_m` tiles, and the rows past the last group form one more region that is written
with zeros. Each program reads its tile's group g, start and end rows from the table, runs the K loop of
lhs[tile] @ rhs[g][:, N block] with fp32 accumulation and stores the rows in [start, end) only. Tiles never move
rows: a tile that starts less than block_m rows before the end of lhs loads from M - block_m on (all in bounds) and
masks the rows before its start, so lhs is never padded or copied. Rows of a tile outside its group belong to
neighbouring groups; they are computed with the wrong weights and never stored, which is exact because matmul rows
are independent.

Backward (`jax.custom_vjp`): d lhs is the same kernel on (d out, rhs[g]^T); d rhs[g] = lhs_g^T d out_g is a second
launch over (N block, K block, group), each program looping over its group's row tiles (a dynamic trip count) with
both operands masked to the group's rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxckpt.ops.common import device

_F32 = jnp.float32
_I32 = jnp.int32
_NN = ((1,), (0,))  # a @ b
_NT = ((1,), (1,))  # a @ b^T
_TN = ((0,), (0,))  # a^T @ b
MIN_TILE = 16
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Tiles and launch parameters of the Pallas Triton grouped matmul.

    block_m: rows per tile (each group's rows are cut into block_m tiles, so small groups waste up to block_m - 1
    rows of compute); block_n: output columns per program; block_k: the K step of the fp32-accumulated loop.
    All three are powers of two >= 16. num_warps, num_stages: Triton's warps per program and software-pipelining
    depth of the K loop.
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or not _is_pow2(value) or value < MIN_TILE:
                raise ValueError(f"config: {name} must be a power of two >= {MIN_TILE}, got {value!r}")
        if not isinstance(self.num_warps, int) or not _is_pow2(self.num_warps) or self.num_warps > 16:
            raise ValueError(f"config: num_warps must be a power of two <= 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"config: num_stages must be a positive int, got {self.num_stages!r}")


def default_config(num_rows: int, k: int, n: int, num_groups: int, dtype) -> GroupedMatmulConfig:
    """The default tiles for lhs [num_rows, k], rhs [num_groups, k, n] in `dtype`.

    block_m follows the mean group size: every group wastes on average block_m / 2 rows of compute in its last
    tile, so groups of a few hundred rows (MoE with many experts) take 64-row tiles, larger ones 128. fp32 halves
    block_k to keep the pipelined K stages in shared memory.
    """
    mean_rows = num_rows / max(num_groups, 1)
    block_m = 64 if mean_rows <= 512 else 128
    wide = jnp.dtype(dtype).itemsize == 4
    block_k = 32 if wide else 64
    return GroupedMatmulConfig(block_m=block_m, block_n=128, block_k=block_k,
                               num_warps=4 if block_m == 64 else 8, num_stages=3 if wide else 4)


def num_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """The static bound on row tiles: cdiv(num_rows, block_m) + num_groups (each of the num_groups + 1 regions,
    the groups and the rows past them, adds at most one partial tile)."""
    return -(-num_rows // block_m) + num_groups


def group_bounds(group_sizes, num_rows: int):
    """(starts i32[G], ends i32[G]) of each group's rows, sizes clipped to >= 0 and ends to num_rows."""
    sizes = jnp.maximum(group_sizes.astype(_I32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes, dtype=_I32), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), _I32), ends[:-1]])
    return starts, ends


def tile_table(group_sizes, num_rows: int, block_m: int):
    """The row tiles of lhs [num_rows, K] for group_sizes i32[G]: (group, start, end), each i32[num_tiles].

    Tile t covers rows [start, min(start + block_m, end)) of group `group` < G; group == G marks the tiles of the
    rows past the last group (written as zeros), group == G + 1 unused tiles (start == end == 0).
    """
    num_groups = group_sizes.shape[0]
    starts, ends = group_bounds(group_sizes, num_rows)
    total = jnp.max(ends, initial=0)
    region_start = jnp.concatenate([starts, total[None]])                  # i32[G + 1]
    region_end = jnp.concatenate([ends, jnp.full((1,), num_rows, _I32)])  # i32[G + 1]
    tiles = (region_end - region_start + block_m - 1) // block_m           # i32[G + 1]
    tile_end = jnp.cumsum(tiles, dtype=_I32)                               # i32[G + 1]
    t = jnp.arange(num_tiles(num_rows, num_groups, block_m), dtype=_I32)
    region = jnp.searchsorted(tile_end, t, side="right").astype(_I32)     # first region whose tiles end past t
    used = region <= num_groups
    r = jnp.minimum(region, num_groups)
    start = region_start[r] + (t - (tile_end[r] - tiles[r])) * block_m
    return (jnp.where(used, r, num_groups + 1), jnp.where(used, start, 0), jnp.where(used, region_end[r], 0))


def _dot(a, b, dims, precision):
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=_F32)


def _tile_rows(start, end, num_rows, block_m):
    """(first row loaded, bool[block_m] rows of [start, end)): the load window is shifted back inside lhs."""
    base = jnp.minimum(start, num_rows - block_m)
    rows = base + jnp.arange(block_m, dtype=_I32)
    return base, (rows >= start) & (rows < end)


def _gmm_kernel(group_ref, start_ref, end_ref, lhs_ref, rhs_ref, out_ref, *, block_m, block_n, block_k,
                num_groups, transpose_rhs, precision):
    n, t = pl.program_id(0), pl.program_id(1)
    g, start, end = group_ref[t], start_ref[t], end_ref[t]
    num_rows, depth = lhs_ref.shape
    base, live = _tile_rows(start, end, num_rows, block_m)
    mask = jnp.broadcast_to(live[:, None], (block_m, block_n))
    rows = pl.ds(base, block_m)
    cols = pl.ds(pl.multiple_of(n * block_n, block_n), block_n)

    @pl.when(g < num_groups)
    def _matmul():
        def step(k, acc):
            ks = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
            a = lhs_ref[rows, ks]                                    # [bm, bk]
            if transpose_rhs:
                return acc + _dot(a, rhs_ref[g, cols, ks], _NT, precision)  # rhs[g] [N, K] block [bn, bk]
            return acc + _dot(a, rhs_ref[g, ks, cols], _NN, precision)      # rhs[g] [K, N] block [bk, bn]

        acc = jax.lax.fori_loop(0, depth // block_k, step, jnp.zeros((block_m, block_n), _F32))
        plt.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), mask=mask)

    @pl.when(g == num_groups)
    def _zeros():
        plt.store(out_ref.at[rows, cols], jnp.zeros((block_m, block_n), out_ref.dtype), mask=mask)


def _tgmm_kernel(start_ref, end_ref, lhs_ref, dout_ref, out_ref, *, block_m, block_n, block_k, precision):
    n, kb, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = start_ref[g], end_ref[g]
    num_rows = lhs_ref.shape[0]
    ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
    cols = pl.ds(pl.multiple_of(n * block_n, block_n), block_n)

    def step(i, acc):
        base, live = _tile_rows(start + i * block_m, end, num_rows, block_m)
        rows = pl.ds(base, block_m)
        # both operands masked: rows of other groups must add nothing, not even inf * 0
        a = plt.load(lhs_ref.at[rows, ks], mask=jnp.broadcast_to(live[:, None], (block_m, block_k)), other=0)
        d = plt.load(dout_ref.at[rows, cols], mask=jnp.broadcast_to(live[:, None], (block_m, block_n)), other=0)
        return acc + _dot(a, d, _TN, precision)

    count = (end - start + block_m - 1) // block_m
    acc = jax.lax.fori_loop(0, count, step, jnp.zeros((block_k, block_n), _F32))
    out_ref[...] = acc.astype(out_ref.dtype)


class _Static(NamedTuple):
    config: GroupedMatmulConfig | None
    precision: jax.lax.Precision | None
    out_dtype: jnp.dtype
    interpret: bool


def _fit(size: int, block: int) -> tuple[int, int]:
    """(tile, padded size): the largest power of two <= block (>= 16) that divides size, else size padded to 16."""
    tile = block
    while tile > MIN_TILE and size % tile:
        tile //= 2
    if size % tile:
        return MIN_TILE, -(-size // MIN_TILE) * MIN_TILE
    return tile, size


def _pad_to(x, axis, size):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _gmm(lhs, rhs, group_sizes, *, config, precision, out_dtype, interpret, transpose_rhs=False):
    """lhs [M, K] @ rhs[g] ([G, K, N], or [G, N, K] read transposed) per group -> [M, N] in out_dtype."""
    num_rows, depth = lhs.shape
    num_groups = rhs.shape[0]
    width = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if num_rows == 0 or width == 0 or num_groups == 0 or depth == 0:
        return jnp.zeros((num_rows, width), out_dtype)
    if config is None:
        config = default_config(num_rows, depth, width, num_groups, lhs.dtype)
    block_k, depth_p = _fit(depth, config.block_k)
    block_n, width_p = _fit(width, config.block_n)
    block_m = config.block_m
    rows_p = max(num_rows, block_m)  # the shifted load window needs block_m rows
    lhs = _pad_to(_pad_to(lhs, 1, depth_p), 0, rows_p)
    rhs = _pad_to(_pad_to(rhs, 2 if transpose_rhs else 1, depth_p), 1 if transpose_rhs else 2, width_p)
    group, start, end = tile_table(group_sizes, num_rows, block_m)
    kernel = functools.partial(_gmm_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                               num_groups=num_groups, transpose_rhs=transpose_rhs, precision=precision)
    full = pl.BlockSpec()
    out = pl.pallas_call(
        kernel,
        grid=(width_p // block_n, group.shape[0]),  # N blocks innermost: a tile's programs share its lhs rows in L2
        in_specs=[full] * 5,
        out_specs=full,
        out_shape=jax.ShapeDtypeStruct((rows_p, width_p), out_dtype),
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(group, start, end, lhs, rhs)
    return out[:num_rows, :width]


def _tgmm(lhs, dout, group_sizes, *, num_groups, config, precision, out_dtype, interpret):
    """lhs_g^T @ dout_g per group: lhs [M, K], dout [M, N] -> [G, K, N] (zeros for empty groups)."""
    num_rows, depth = lhs.shape
    width = dout.shape[1]
    if num_rows == 0 or width == 0 or num_groups == 0 or depth == 0:
        return jnp.zeros((num_groups, depth, width), out_dtype)
    if config is None:
        config = default_config(num_rows, depth, width, num_groups, lhs.dtype)
    block_k, depth_p = _fit(depth, config.block_k)
    block_n, width_p = _fit(width, config.block_n)
    block_m = config.block_m
    rows_p = max(num_rows, block_m)
    lhs = _pad_to(_pad_to(lhs, 1, depth_p), 0, rows_p)
    dout = _pad_to(_pad_to(dout, 1, width_p), 0, rows_p)
    starts, ends = group_bounds(group_sizes, num_rows)
    kernel = functools.partial(_tgmm_kernel, block_m=block_m, block_n=block_n, block_k=block_k, precision=precision)
    full = pl.BlockSpec()
    out = pl.pallas_call(
        kernel,
        grid=(width_p // block_n, depth_p // block_k, num_groups),
        in_specs=[full] * 4,
        out_specs=pl.BlockSpec((None, block_k, block_n), lambda n, k, g: (g, k, n)),
        out_shape=jax.ShapeDtypeStruct((num_groups, depth_p, width_p), out_dtype),
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="grouped_matmul_rhs_grad",
    )(starts, ends, lhs, dout)
    return out[:, :depth, :width]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _differentiable(lhs, rhs, group_sizes, static: _Static):
    return _gmm(lhs, rhs, group_sizes, config=static.config, precision=static.precision,
                out_dtype=static.out_dtype, interpret=static.interpret)


def _fwd(lhs, rhs, group_sizes, static):
    return _differentiable(lhs, rhs, group_sizes, static), (lhs, rhs, group_sizes)


def _bwd(static, residuals, dout):
    lhs, rhs, group_sizes = residuals
    # the cotangent enters the kernels in the operands' dtype (16-bit products on the tensor cores, fp32 sums)
    dout = dout.astype(rhs.dtype)
    options = dict(config=None, precision=static.precision, interpret=static.interpret)
    dlhs = _gmm(dout, rhs, group_sizes, out_dtype=lhs.dtype, transpose_rhs=True, **options)
    drhs = _tgmm(lhs.astype(rhs.dtype), dout, group_sizes, num_groups=rhs.shape[0], out_dtype=rhs.dtype, **options)
    return dlhs, drhs, None


_differentiable.defvjp(_fwd, _bwd)


def supports(lhs, rhs, *, interpret=False) -> str | None:
    """None when this backend runs the call, else the reason it cannot."""
    if not interpret and not device.is_gpu():
        return f"backend: the Triton kernel needs a GPU (or interpret=True), got {jax.default_backend()!r}"
    if jnp.dtype(lhs.dtype) not in DTYPES:
        return f"lhs: dtype must be one of bfloat16, float16, float32 for pallas_triton, got {lhs.dtype}"
    return None


@functools.partial(jax.jit, static_argnames=("preferred_element_type", "precision", "config", "interpret"))
def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None, precision=None,
                   config: GroupedMatmulConfig | None = None, interpret: bool = False):
    """Pallas Triton grouped matmul: lhs [M, K] (rows sorted by group), rhs [G, K, N], group_sizes i32[G] -> [M, N].

    Inputs are assumed validated by `jaxckpt.ops.grouped_matmul.api` (same dtype, shapes). precision applies to
    fp32 inputs: HIGHEST is IEEE fp32, anything else TF32 on the tensor cores; 16-bit inputs multiply exactly into
    fp32 sums. config None: `default_config`. Differentiable in lhs and rhs.
    """
    out_dtype = jnp.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
    return _differentiable(lhs, rhs, group_sizes.astype(_I32), _Static(config, precision, out_dtype, interpret))
