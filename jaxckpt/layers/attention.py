"""Causal GQA/MHA with RoPE over a paged KV cache, in plain jnp (correct before fast).

Each step writes its tokens' K/V into the cache pages named by the block tables, then every query token attends over
the pages of its row up to its own position (context and this step's tokens alike). Queries go a tile at a time: a
tile inside one row gathers that row's pages once ([MAXB * block_size, kv_heads, head_dim]) and attends densely;
the few tiles that straddle rows gather per token. fp32 caches attend at HIGHEST precision (the CPU tests compare
against an uncached reference); 16-bit caches use the tensor cores with fp32 accumulation.

`paged_attention` (the paged write and attend) and `causal_attention` (its dense oracle) take projected heads, so
model-specific attentions (gated, q/k-normed, MLA) reuse them around their own projections.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.layers.common import Linear
from jaxckpt.layers.metadata import StepMetadata
from jaxckpt.plan.layout import searchsorted

_HIGHEST = jax.lax.Precision.HIGHEST


def rope(x, positions, *, theta: float, rotary_dim: int | None = None):
    """Rotary embedding, rotate-half (GPT-NeoX) form, on the first `rotary_dim` channels of each head (all when None;
    Qwen3-Next rotates a quarter): x [T, H, D], positions i32[T]."""
    rotary_dim = x.shape[-1] if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= x.shape[-1]:
        raise ValueError(f"rotary_dim: must be even and in (0, {x.shape[-1]}], got {rotary_dim}")
    half = rotary_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, rotary_dim / 2]
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
    x32 = x.astype(jnp.float32)
    x1, x2, rest = x32[..., :half], x32[..., half:rotary_dim], x32[..., rotary_dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1).astype(x.dtype)


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


ATTENTION_IMPLEMENTATIONS = ("xla", "pallas_triton")


def check_attention_implementation(implementation: str | None) -> str | None:
    if implementation is not None and implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"implementation: paged attention is one of {ATTENTION_IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    return implementation


def choose_attention(q, k_pages, v_pages, implementation: str | None) -> str:
    """The paged attention that runs: `implementation` when given (it raises if the shapes are not supported), else
    on a GPU the Pallas Triton flash attention where it supports the shapes (measured against the plain path in
    `bench/results/models_prefill_attention_h200.md`), and the plain path ("xla") elsewhere."""
    if check_attention_implementation(implementation) is not None:
        return implementation
    if jax.default_backend() == "gpu":
        from jaxckpt.layers import attention_pallas_triton

        if attention_pallas_triton.supports(q, k_pages, v_pages) is None:
            return "pallas_triton"
    return "xla"


def paged_attention(q, k, v, meta: StepMetadata, pools, *, block_size: int, query_tile: int = 64,
                    implementation: str | None = None, interpret: bool = False):
    """Writes this step's k, v to the pages named by the block tables (padding tokens write nothing), then each query
    token attends over its row's pages up to its own position.

    q [T, Hkv, r, Dk] (rotated and scaled, fp32), k [T, Hkv, Dk], v [T, Hkv, Dv]; pools (k_pages [P, block_size, Hkv,
    Dk], v_pages [P, block_size, Hkv, Dv]). Returns (out fp32 [T, Hkv, r, Dv], (k_pages, v_pages)).
    `implementation`: "xla" (this plain path, the reference), "pallas_triton" (`attention_pallas_triton`, flash
    attention over the pages; `interpret=True` runs it in the Pallas interpreter), None: `choose_attention`'s pick.
    """
    k_pages, v_pages = pools
    num_tokens = q.shape[0]
    num_kv_heads = k.shape[1]
    cu = meta.cu_seqlens
    num_rows = cu.shape[0] - 1
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    rows = jnp.clip(searchsorted(jnp, cu[1:], token, side="right"), 0, num_rows - 1).astype(jnp.int32)
    real = token < cu[num_rows]
    positions = meta.positions
    page = jnp.where(real, meta.block_tables[rows, positions // block_size], k_pages.shape[0])
    within = positions % block_size
    k_pages = k_pages.at[page, within].set(k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[page, within].set(v.astype(v_pages.dtype), mode="drop")
    if choose_attention(q, k_pages, v_pages, implementation) == "pallas_triton":
        from jaxckpt.layers import attention_pallas_triton

        out = attention_pallas_triton.attend(q, k_pages, v_pages, cu, positions, meta.block_tables,
                                             interpret=interpret)
        return out, (k_pages, v_pages)
    span = meta.block_tables.shape[1] * block_size

    def row_pages(row):
        pages = meta.block_tables[row]  # [MAXB]
        return (k_pages[pages].reshape(span, num_kv_heads, k_pages.shape[-1]),
                v_pages[pages].reshape(span, num_kv_heads, v_pages.shape[-1]))

    def attend_token(q_t, row, pos):
        return _attend(q_t[None], *row_pages(row), (jnp.arange(span) <= pos)[None])[0]

    def attend_tile(args):
        q_tile, row_tile, pos_tile = args  # [Q, Hkv, r, D], i32[Q], i32[Q]
        valid = jnp.arange(span)[None, :] <= pos_tile[:, None]  # [Q, span]
        return jax.lax.cond(row_tile[0] == row_tile[-1],
                            lambda: _attend(q_tile, *row_pages(row_tile[0]), valid),
                            lambda: jax.vmap(attend_token)(q_tile, row_tile, pos_tile))

    pad = -num_tokens % query_tile
    # padding queries repeat the last token's row and position, so they never make a tile straddle rows
    tiles = [jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)]).reshape(-1, query_tile, *a.shape[1:])
             for a in (q, rows, positions)]
    out = jax.lax.map(attend_tile, tiles)
    out = out.reshape(num_tokens + pad, *q.shape[1:3], v_pages.shape[-1])[:num_tokens]
    return out, (k_pages, v_pages)


def causal_attention(q, k, v):
    """Dense causal attention over one whole sequence, no cache: q [T, Hkv, r, Dk] (scaled, fp32), k [T, Hkv, Dk],
    v [T, Hkv, Dv] -> fp32 [T, Hkv, r, Dv]."""
    num_tokens = q.shape[0]
    causal = jnp.arange(num_tokens)[None, :] <= jnp.arange(num_tokens)[:, None]  # [T, T]
    scores = jnp.einsum("tgrd,lgd->tgrl", q, k.astype(jnp.float32), precision=_HIGHEST)
    probs = jax.nn.softmax(jnp.where(causal[:, None, None, :], scores, -jnp.inf), axis=-1)
    return jnp.einsum("tgrl,lgd->tgrd", probs, v.astype(jnp.float32), precision=_HIGHEST)


class Attention(nnx.Module):
    """Causal attention, num_heads query heads over num_kv_heads K/V heads of head_dim, RoPE on q and k.

    q_proj.weight [Hq * D, d_model], k_proj.weight / v_proj.weight [Hkv * D, d_model], o_proj.weight [d_model, Hq * D]
    Cache per layer: (k_pages, v_pages), each [num_pages, block_size, Hkv, D]; page 0 is the null page.
    """

    def __init__(self, d_model: int, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 rope_theta: float = 10000.0, query_tile: int = 64, implementation: str | None = None,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: must divide num_heads={num_heads}, got {num_kv_heads}")
        if head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {head_dim}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.rope_theta = rope_theta
        self.query_tile = query_tile
        self.implementation = check_attention_implementation(implementation)
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
        q, k, v = self._qkv(x, meta.positions)
        out, pools = paged_attention(q, k, v, meta, pools, block_size=self.block_size, query_tile=self.query_tile,
                                     implementation=self.implementation)
        return self.o_proj(out.reshape(x.shape[0], -1).astype(x.dtype)), pools

    def reference(self, x, *, implementation=None):
        """One whole sequence x [T, d_model], dense causal attention, no cache."""
        out = causal_attention(*self._qkv(x, jnp.arange(x.shape[0])))
        return self.o_proj(out.reshape(x.shape[0], -1).astype(x.dtype))
