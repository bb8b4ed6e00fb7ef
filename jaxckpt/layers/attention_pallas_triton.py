"""Flash attention over the paged KV cache in Pallas Triton: the fast GPU path of `paged_attention`.

One program per (query tile, KV head). A query tile is up to `block_q` consecutive tokens of one row, with all `r`
query heads that share the KV head packed as rows of one [block_q * r, D] operand, so each K/V tile loaded from a
page serves every head of its group. The program walks the row's KV tiles up to the tile's last position with an
online softmax (fp32 running max, sum and accumulator); a KV tile never straddles a page (`block_k` divides the
page size), so its page is one scalar read of the block table; a step of the walk takes KEYS_PER_STEP = 64 keys as
64 / block_k such tiles and rescales the accumulator once, however small the pages. Keys past the tile's last
position are loaded as zeros: pages that no forward wrote may hold anything (NaN in the tests) and must not reach
the accumulator even with a zero weight. Causality inside the tile is a mask on the scores.

Tiles never straddle rows: the tile table (row, first token, length, first position) is built in jnp from the
traced metadata, with a static bound of cdiv(T, block_q) + N tiles; tiles past the real ones have length 0 and
exit at once. Padding tokens get no tile and come out as zeros.

fp32 inputs take fp32 products at HIGHEST precision (the CPU tests in interpret mode compare against the plain
path); 16-bit inputs use the tensor cores with fp32 accumulation, as the plain path does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxckpt.plan.layout import searchsorted

_F32 = jnp.float32
_NEG = -1e30  # finite: exp(_NEG - m) is 0 and no -inf - -inf can appear
KEYS_PER_STEP = 64


def block_sizes(num_groups: int, page_size: int, *, block_q: int | None = None) -> tuple[int, int]:
    """(block_q, block_k): block_q * num_groups query rows per program (128 by default), block_k the largest power
    of two up to KEYS_PER_STEP dividing the page size."""
    if block_q is None:
        block_q = max(1, 128 // num_groups)
    block_k = KEYS_PER_STEP
    while page_size % block_k:
        block_k //= 2
    return block_q, block_k


def supports(q, k_pages, v_pages, *, block_q: int | None = None) -> str | None:
    """None when the kernel runs these shapes, else the reason it declines."""
    _, _, num_groups, head_dim = q.shape
    page_size, value_dim = k_pages.shape[1], v_pages.shape[-1]
    block_q, block_k = block_sizes(num_groups, page_size, block_q=block_q)
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    if not (pow2(num_groups) and pow2(block_q)):
        return f"num_heads / num_kv_heads = {num_groups} and block_q = {block_q} must be powers of two (Triton tiles)"
    if not (pow2(head_dim) and head_dim >= 16 and pow2(value_dim) and value_dim >= 16):
        return f"head dims {head_dim}, {value_dim} must be powers of two of at least 16 (Triton tiles)"
    if block_q * num_groups < 16:
        return f"block_q * group = {block_q * num_groups} query rows, Triton dots need at least 16"
    if block_k < 16:
        return f"page size {page_size}: no power of two of at least 16 divides it (Triton dots need 16 keys)"
    return None


def _dot(a, b, dims):
    precision = jax.lax.Precision.HIGHEST if a.dtype == _F32 else None
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=_F32)


def _kernel(tile_row_ref, tile_start_ref, tile_len_ref, tile_pos_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, *,
            block_q: int, block_k: int, num_groups: int, page_size: int):
    t, g = pl.program_id(0), pl.program_id(1)
    length = tile_len_ref[t]

    @pl.when(length > 0)
    def _():
        row, start, first = tile_row_ref[t], tile_start_ref[t], tile_pos_ref[t]
        rows = block_q * num_groups
        # lax.div / lax.rem, not // and %: jnp's floor forms lower to a sign test the Triton lowering rejects
        # (every operand here is non-negative, where truncation is the floor)
        token = jax.lax.div(jnp.arange(rows, dtype=jnp.int32), jnp.int32(num_groups))  # query row -> tile token
        valid = token < length
        q = plt.load(q_ref.at[g, pl.ds(start * num_groups, rows), :], mask=valid[:, None], other=0)  # [R, D]
        q_pos = first + token
        last = first + length - 1

        def body(j, carry):
            # KEYS_PER_STEP keys a step, as sub-tiles of block_k that each lie in one page: one rescale of the
            # accumulator per step however small the pages
            m, l, acc = carry
            tiles = []
            for sub in range(KEYS_PER_STEP // block_k):
                kv0 = j * KEYS_PER_STEP + sub * block_k
                column = jnp.minimum(jax.lax.div(kv0, jnp.int32(page_size)), tables_ref.shape[1] - 1)
                page = tables_ref[row, column]  # past the row's last key the loads are masked off
                kv_pos = kv0 + jnp.arange(block_k, dtype=jnp.int32)
                readable = (kv_pos <= last)[:, None]
                within = pl.ds(jax.lax.rem(kv0, jnp.int32(page_size)), block_k)
                k = plt.load(k_ref.at[page, within, g, :], mask=readable, other=0)  # [BK, D]
                v = plt.load(v_ref.at[page, within, g, :], mask=readable, other=0)  # [BK, Dv]
                scores = _dot(q, k, ((1,), (1,)))  # [R, BK]
                tiles.append((jnp.where(kv_pos[None, :] <= q_pos[:, None], scores, _NEG), v))
            m_new = m
            for scores, _ in tiles:
                m_new = jnp.maximum(m_new, jnp.max(scores, axis=1))
            alpha = jnp.exp(m - m_new)
            l, acc = l * alpha, acc * alpha[:, None]
            for scores, v in tiles:
                p = jnp.exp(scores - m_new[:, None])
                l = l + jnp.sum(p, axis=1)
                acc = acc + _dot(p.astype(v.dtype), v, ((1,), (0,)))
            return m_new, l, acc

        init = (jnp.full((rows,), _NEG, _F32), jnp.zeros((rows,), _F32),
                jnp.zeros((rows, o_ref.shape[-1]), _F32))
        _, l, acc = jax.lax.fori_loop(0, jax.lax.div(last, jnp.int32(KEYS_PER_STEP)) + 1, body, init)
        plt.store(o_ref.at[g, pl.ds(start * num_groups, rows), :], acc / l[:, None], mask=valid[:, None])


def tile_table(cu_seqlens, positions, *, block_q: int):
    """(row, first token, length, first position) of each query tile, i32[cdiv(T, block_q) + N] each."""
    num_tokens = positions.shape[0]
    num_rows = cu_seqlens.shape[0] - 1
    num_tiles = -(-num_tokens // block_q) + num_rows
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    tiles_cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum((lens + block_q - 1) // block_q)])
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    row = jnp.clip(searchsorted(jnp, tiles_cu[1:], tile, side="right"), 0, num_rows - 1).astype(jnp.int32)
    start = cu_seqlens[row] + (tile - tiles_cu[row]) * block_q
    length = jnp.where(tile < tiles_cu[num_rows], jnp.clip(cu_seqlens[row + 1] - start, 0, block_q), 0)
    first = positions[jnp.clip(start, 0, num_tokens - 1)]
    return row, start.astype(jnp.int32), length.astype(jnp.int32), first


@functools.partial(jax.jit, static_argnames=("block_q", "num_warps", "num_stages", "interpret"))
def attend(q, k_pages, v_pages, cu_seqlens, positions, block_tables, *, block_q: int | None = None,
           num_warps: int = 8, num_stages: int = 2, interpret: bool = False):
    """q [T, Hkv, r, D] (rotated and scaled), pages [P, page, Hkv, D] already holding this step's K/V; each query
    token attends over its row's keys up to its own position. Returns fp32 [T, Hkv, r, Dv], zeros for padding."""
    num_tokens, num_kv_heads, num_groups, head_dim = q.shape
    page_size, value_dim = k_pages.shape[1], v_pages.shape[-1]
    block_q, block_k = block_sizes(num_groups, page_size, block_q=block_q)
    reason = supports(q, k_pages, v_pages, block_q=block_q)
    if reason is not None:
        raise ValueError(f"implementation: 'pallas_triton' paged attention declines: {reason}")
    rows = block_q * num_groups
    # [Hkv, T * r (+ one tile of slack, so no tile's slice runs past the end), D]
    packed = jnp.moveaxis(q.astype(k_pages.dtype), 1, 0).reshape(num_kv_heads, num_tokens * num_groups, head_dim)
    packed = jnp.pad(packed, ((0, 0), (0, rows), (0, 0)))
    tiles = tile_table(cu_seqlens, positions, block_q=block_q)
    out = pl.pallas_call(
        functools.partial(_kernel, block_q=block_q, block_k=block_k, num_groups=num_groups, page_size=page_size),
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, num_tokens * num_groups + rows, value_dim), _F32),
        grid=(tiles[0].shape[0], num_kv_heads), in_specs=[pl.BlockSpec()] * 8, out_specs=pl.BlockSpec(),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages), interpret=interpret,
        name="paged_flash_attention",
    )(*tiles, block_tables, packed, k_pages, v_pages)
    out = out[:, :num_tokens * num_groups].reshape(num_kv_heads, num_tokens, num_groups, value_dim)
    out = jnp.moveaxis(out, 0, 1)
    real = jnp.arange(num_tokens) < cu_seqlens[-1]
    return jnp.where(real[:, None, None, None], out, 0.0)
