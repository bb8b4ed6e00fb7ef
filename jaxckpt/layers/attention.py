"""Causal GQA/MHA with RoPE over a paged KV cache, in plain jnp (correct before fast).

Each step writes its tokens' K/V into the cache pages named by the block tables, then every query token attends over
the pages of its row up to its own position (context and this step's tokens alike). Queries go a tile at a time: a
tile inside one row gathers that row's pages once ([MAXB * block_size, kv_heads, head_dim]) and attends densely;
the few tiles that straddle rows gather per token. fp32 caches attend at HIGHEST precision (the CPU tests compare
against an uncached reference); 16-bit caches use the tensor cores with fp32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.layers.common import Linear
from jaxckpt.layers.metadata import StepMetadata
from jaxckpt.plan.layout import searchsorted

_HIGHEST = jax.lax.Precision.HIGHEST


def rope(x, positions, *, theta: float):
    """Rotary embedding, rotate-half (GPT-NeoX) form: x [T, H, D], positions i32[T]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, D / 2]
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _attend(q, k, v, valid):
    """q [Q, Hkv, r, D] (scaled, fp32); k, v [L, Hkv, D]; valid bool[Q, L] -> [Q, Hkv, r, D] fp32."""
    # keys no query may read can be garbage (other rows' pages, never-written NaN pages): zero them, not just mask
    readable = valid.any(axis=0)[:, None, None]
    k = jnp.where(readable, k, jnp.zeros((), k.dtype))
    v = jnp.where(readable, v, jnp.zeros((), v.dtype))
    precision = _HIGHEST if k.dtype == jnp.float32 else None
    scores = jnp.einsum("qgrd,lgd->qgrl", q.astype(k.dtype), k, precision=precision,
                        preferred_element_type=jnp.float32)
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("qgrl,lgd->qgrd", probs.astype(v.dtype), v, precision=precision,
                      preferred_element_type=jnp.float32)


class Attention(nnx.Module):
    """Causal attention, num_heads query heads over num_kv_heads K/V heads of head_dim, RoPE on q and k.

    q_proj.weight [Hq * D, d_model], k_proj.weight / v_proj.weight [Hkv * D, d_model], o_proj.weight [d_model, Hq * D]
    Cache per layer: (k_pages, v_pages), each [num_pages, block_size, Hkv, D]; page 0 is the null page.
    """

    def __init__(self, d_model: int, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 rope_theta: float = 10000.0, query_tile: int = 64, dtype=jnp.float32, rngs: nnx.Rngs):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: must divide num_heads={num_heads}, got {num_kv_heads}")
        if head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {head_dim}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.rope_theta = rope_theta
        self.query_tile = query_tile
        self.q_proj = Linear(d_model, num_heads * head_dim, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d_model, num_kv_heads * head_dim, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d_model, num_kv_heads * head_dim, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(num_heads * head_dim, d_model, dtype=dtype, rngs=rngs)

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """Shape of one KV page: [block_size, Hkv, D]."""
        return self.block_size, self.num_kv_heads, self.head_dim

    def _qkv(self, x, positions):
        num_tokens = x.shape[0]
        q = self.q_proj(x).reshape(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q = rope(q, positions, theta=self.rope_theta).astype(jnp.float32) * self.head_dim ** -0.5
        q = q.reshape(num_tokens, self.num_kv_heads, -1, self.head_dim)  # [T, Hkv, r, D]
        return q, rope(k, positions, theta=self.rope_theta), v

    @jax.named_scope("paged_attention")
    def __call__(self, x, meta: StepMetadata, pools):
        """x [T, d_model] packed rows; pools (k_pages, v_pages) [P, block_size, Hkv, D].

        Returns (out [T, d_model], (k_pages, v_pages)) with this step's K/V written (padding tokens write nothing).
        """
        k_pages, v_pages = pools
        num_tokens = x.shape[0]
        cu = meta.cu_seqlens
        num_rows = cu.shape[0] - 1
        token = jnp.arange(num_tokens, dtype=jnp.int32)
        rows = jnp.clip(searchsorted(jnp, cu[1:], token, side="right"), 0, num_rows - 1).astype(jnp.int32)
        real = token < cu[num_rows]
        positions = meta.positions
        q, k, v = self._qkv(x, positions)
        page = jnp.where(real, meta.block_tables[rows, positions // self.block_size], k_pages.shape[0])
        within = positions % self.block_size
        k_pages = k_pages.at[page, within].set(k.astype(k_pages.dtype), mode="drop")
        v_pages = v_pages.at[page, within].set(v.astype(v_pages.dtype), mode="drop")
        span = meta.block_tables.shape[1] * self.block_size

        def row_pages(row):
            pages = meta.block_tables[row]  # [MAXB]
            shape = (span, self.num_kv_heads, self.head_dim)
            return k_pages[pages].reshape(shape), v_pages[pages].reshape(shape)

        def attend_token(q_t, row, pos):
            return _attend(q_t[None], *row_pages(row), (jnp.arange(span) <= pos)[None])[0]

        def attend_tile(args):
            q_tile, row_tile, pos_tile = args  # [Q, Hkv, r, D], i32[Q], i32[Q]
            valid = jnp.arange(span)[None, :] <= pos_tile[:, None]  # [Q, span]
            return jax.lax.cond(row_tile[0] == row_tile[-1],
                                lambda: _attend(q_tile, *row_pages(row_tile[0]), valid),
                                lambda: jax.vmap(attend_token)(q_tile, row_tile, pos_tile))

        tile = self.query_tile
        pad = -num_tokens % tile
        # padding queries repeat the last token's row and position, so they never make a tile straddle rows
        tiles = [jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)]).reshape(-1, tile, *a.shape[1:])
                 for a in (q, rows, positions)]
        out = jax.lax.map(attend_tile, tiles).reshape(num_tokens + pad, *q.shape[1:])[:num_tokens]
        out = out.reshape(num_tokens, self.num_heads * self.head_dim).astype(x.dtype)
        return self.o_proj(out), (k_pages, v_pages)

    def reference(self, x, *, implementation=None):
        """One whole sequence x [T, d_model], dense causal attention, no cache."""
        num_tokens = x.shape[0]
        q, k, v = self._qkv(x, jnp.arange(num_tokens))
        causal = jnp.arange(num_tokens)[None, :] <= jnp.arange(num_tokens)[:, None]  # [T, T]
        scores = jnp.einsum("tgrd,lgd->tgrl", q, k.astype(jnp.float32), precision=_HIGHEST)
        probs = jax.nn.softmax(jnp.where(causal[:, None, None, :], scores, -jnp.inf), axis=-1)
        out = jnp.einsum("tgrl,lgd->tgrd", probs, v.astype(jnp.float32), precision=_HIGHEST)
        return self.o_proj(out.reshape(num_tokens, -1).astype(x.dtype))
