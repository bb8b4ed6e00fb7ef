"""The first stage of both kernel pipelines of the delta rule (`pallas_triton`, `pallas_mosaic_gpu`): metadata, input
casts, the optional L2 norms of q and k, and G, the gate's chunk-local inclusive cumulative log decay, written
chunk-major [HV, NC, C(, K)] in fp32; for fp32 I/O as two arrays, hi + lo (`log_decay.split_cumsum`), so that every
exp(G_a - G_b) a later kernel takes is of (hi_a - hi_b) + (lo_a - lo_b), whose error does not grow with the decays
before the pair (`pallas_triton_tiles.Cumsum`). A separate launch because every later kernel reads sub-tiles and
single rows of G, and register tiles cannot be sliced in the Triton lowering (no `slice` rule).

The cumsum kernel is a Pallas kernel for the Triton lowering, which the Mosaic GPU pipeline runs for GDN (1.1-1.3% of
its default call's device time in the H200 traces, bench/README.md, "The default call on Hopper"). For KDA this
launch ran at the copy floor of the fp32 per-channel gate it reads and the G it writes (5.7-7.4%), which only not
writing G saves: the Mosaic GPU KDA intra kernel forms G itself (`prepare(..., launch_cumsum=False)`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxckpt.ops.common.log_decay import floor_log_decay, split_cumsum
from jaxckpt.ops.common.pallas_triton_tiles import load_tokens
from jaxckpt.ops.common.xla_arrays import packed_metadata
from jaxckpt.ops.delta_rule.chunk import L2NORM_EPS
from jaxckpt.plan.layout import chunk_layout

_F32 = jnp.float32


class Prepared(NamedTuple):
    """What every state pass of the kernel pipelines (`pallas_triton`, `pallas_mosaic_gpu`) starts from."""

    q: object            # [T', H, K] io dtype, L2-normalized if asked (unless `qk_l2norm`: the kernels do it);
    #                      T' = max(T, 1) (a zero row for T = 0)
    k: object            # [T', H, K] io dtype
    v: object            # [T', HV, V]
    beta: object         # [T', HV]
    G: object            # fp32 [HV, NC, C] (GDN) or [HV, NC, C, K] (KDA): chunk-local cumulative log decay (its hi
    #                      part when split)
    lay: object          # `chunk_layout` of the rows and checkpoints (traced)
    cu_seqlens: object   # i32[N + 1]
    checkpoint_cu: object  # i32[N + 1]
    scale: float
    io_dtype: object     # dtype of the stored intermediates: fp32 or the 16-bit input dtype
    G_lo: object = None  # G's lo part (`gate_cumsum(..., split=True)`), as G; None: G is whole
    g: object = None     # fp32 [T', HV, K]: the raw gate, for a KDA intra kernel that forms G itself (G None)
    qk_l2norm: bool = False  # q and k are raw and the kernels apply `use_qk_l2norm` (`prepare(l2norm_in_kernel=True)`)


def prepare(q, k, v, g, beta, *, per_channel_decay, scale, use_qk_l2norm, cu_seqlens, checkpoint_cu,
            checkpoint_offsets, chunk_size, interpret, intra_num_warps=4, num_stages=2, split_gates=False,
            launch_cumsum=True, l2norm_in_kernel=False) -> Prepared:
    """Metadata, input casts, the optional L2 norms and the gate cumsum launch: what the later passes of both kernel
    pipelines start from. `split_gates`: for fp32 I/O, G as hi + lo (`gate_cumsum(split=True)`), as the Pallas
    Triton pipeline's kernels take it (16-bit inputs keep one G: its cancellation is far below their error class,
    and the second G tile costs KDA time; bench/README.md, "Pallas Triton"). `launch_cumsum=False` (KDA on Mosaic
    GPU, whose intra kernel forms G from the raw gate): no launch, G None and the fp32 gate in `g`.
    `l2norm_in_kernel=True` (the Mosaic GPU intra kernels, which normalize the rows they load): with
    `use_qk_l2norm`, q and k stay raw and `qk_l2norm` says the kernels normalize them; an XLA pass here would read
    and write both once more (about a fifth of GDN's default call at (8, 4096, 32) on Hopper)."""
    num_tokens, _, head_k = q.shape
    chunk = chunk_size
    if scale is None:
        scale = head_k ** -0.5
    io_dtype = intermediate_dtype(k, v)
    cu_seqlens, checkpoint_cu, checkpoint_offsets = packed_metadata(cu_seqlens, checkpoint_cu, checkpoint_offsets,
                                                                    num_tokens)
    qk_l2norm = bool(use_qk_l2norm) and l2norm_in_kernel
    if use_qk_l2norm and not qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q, k = q.astype(io_dtype), k.astype(io_dtype)
    if num_tokens == 0:
        # loads need a source row; a padding token past cu_seqlens[-1] = 0 is never read unmasked
        q, k, v, g, beta = (jnp.zeros((1, *x.shape[1:]), x.dtype) for x in (q, k, v, g, beta))
    lay = chunk_layout(cu_seqlens, checkpoint_cu, checkpoint_offsets, chunk_size=chunk, num_tokens=q.shape[0],
                       xp=jnp)
    if not launch_cumsum:
        return Prepared(q, k, v, beta, None, lay, cu_seqlens, checkpoint_cu, float(scale), io_dtype,
                        g=g.astype(_F32), qk_l2norm=qk_l2norm)
    split = split_gates and io_dtype == _F32
    G = gate_cumsum(lay.chunk_start, lay.chunk_len, g, per_channel_decay=per_channel_decay, chunk=chunk, split=split,
                    interpret=interpret, num_warps=intra_num_warps, num_stages=num_stages)
    G, G_lo = G if split else (G, None)
    return Prepared(q, k, v, beta, G, lay, cu_seqlens, checkpoint_cu, float(scale), io_dtype, G_lo,
                    qk_l2norm=qk_l2norm)


def check_qk_normalized(p: Prepared, *, reader: str):
    """ValueError for a pass that reads `p.q`, `p.k` as the op's q, k when `prepare` left their norms to the
    kernels (`l2norm_in_kernel`): that pass would take raw rows for normalized ones."""
    if p.qk_l2norm:
        raise ValueError(f"{reader} reads q and k as given: prepare them with l2norm_in_kernel=False")


def intermediate_dtype(k, v):
    """The dtype of the stored intermediates: promote(k, v), fp32 if that is 32 bits or wider."""
    io_dtype = jnp.promote_types(k.dtype, v.dtype)
    return _F32 if jnp.dtype(io_dtype).itemsize >= 4 else jnp.dtype(io_dtype)


def l2norm(x):
    x32 = x.astype(_F32)
    return (x32 * l2_scale(jnp.sum(x32 * x32, axis=-1, keepdims=True))).astype(x.dtype)


def l2_scale(r2):
    """1 / |x| from the squared norms r2 (fp32), as `use_qk_l2norm` scales each row: FLA's rsqrt(r2 + eps)."""
    return jax.lax.rsqrt(r2 + L2NORM_EPS)


def gate_cumsum(chunk_start, chunk_len, g, *, per_channel_decay, chunk, split=False, interpret=False, num_warps=4,
                num_stages=2):
    """G, the chunk-local inclusive cumulative log decay (`_cumsum_kernel`).

    chunk_start, chunk_len  # i32[NC] from `jaxckpt.plan.layout.chunk_layout`
    g                       # [T, HV] (GDN) or [T, HV, K] (KDA, `per_channel_decay`): log decay <= 0, any float
                            # dtype; the kernel casts it to fp32 and floors it (`floor_log_decay`) as it loads it
    Returns fp32 [HV, NC, C] or [HV, NC, C, K], chunk-major; rows past a chunk's length repeat its last value.
    With `split`, the pair (hi, lo) whose sum is G: `log_decay.split_cumsum`.
    """
    channel = per_channel_decay
    num_chunks, num_v_heads = chunk_start.shape[0], g.shape[1]
    g_tail = (g.shape[2],) if channel else ()
    G_shape = jax.ShapeDtypeStruct((num_v_heads, num_chunks, chunk, *g_tail), _F32)
    return pl.pallas_call(
        functools.partial(_cumsum_kernel, chunk=chunk, channel=channel),
        out_shape=(G_shape, G_shape) if split else G_shape,
        grid=(num_chunks, num_v_heads), in_specs=[pl.BlockSpec()] * 3,
        out_specs=(gate_block(chunk, g_tail),) * 2 if split else gate_block(chunk, g_tail),
        compiler_params=plt.CompilerParams(num_stages=num_stages, num_warps=num_warps), interpret=interpret,
        name="delta_gate_cumsum",
    )(chunk_start, chunk_len, g)


def gate_block(chunk, g_tail):
    return pl.BlockSpec((None, None, chunk, *g_tail), lambda c, h: (h, c, 0, *(0,) * len(g_tail)))


def _cumsum_kernel(start_ref, len_ref, g_ref, *G_refs, chunk, channel):
    c, h = pl.program_id(0), pl.program_id(1)
    start, length = start_ref[c], len_ref[c]
    rows = jnp.arange(chunk, dtype=jnp.int32)
    shape = G_refs[0].shape
    if channel:
        g = load_tokens(g_ref.at[pl.ds(start, chunk), h, :], rows, length, shape)
    else:
        g = load_tokens(g_ref.at[pl.ds(start, chunk), h], rows, length, shape)
    # floored here, not in XLA before the launch: for KDA's per-channel gate that pass read and wrote the whole fp32
    # gate again (5-7% of the default call on an H200, `loop_maximum_fusion` in bench/results/ops_default_kda_h200)
    g = floor_log_decay(g)
    if len(G_refs) == 1:
        G_refs[0][...] = jnp.cumsum(g, axis=0)
    else:
        G_refs[0][...], G_refs[1][...] = split_cumsum(g, axis=0)
