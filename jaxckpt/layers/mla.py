"""Multi-head latent attention (DeepSeek-V2's MLA) over a paged cache of the latent, in plain jnp.

The cache holds, per token, the compressed KV latent c [R] and the shared rope key k_r [Dr], the two tensors a
transformers cache keeps for an MLA layer, not the per-head keys and values. Attention runs in the absorbed form:
with kv_b_proj's per-head blocks W_uk [Dn, R] and W_uv [Dv, R],

    q_h . k_h = (W_uk^T q_nope_h) . c + q_rope_h . k_r,     out_h = W_uv (sum_t p_ht c_t),

so every head attends over the same R + Dr channels (multi-query attention with one KV head) and the latent is never
expanded per head. `jaxckpt.models.kimi_linear.KimiLinearAttention` projects around this function; its
dense oracle expands k and v per head (transformers' form) and runs `attention.causal_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxckpt.layers.metadata import StepMetadata
from jaxckpt.plan.layout import searchsorted

_HIGHEST = jax.lax.Precision.HIGHEST


def _latent_scores(q_latent, q_rope, latent, k_rope, valid):
    """q_latent [Q, H, R], q_rope [Q, H, Dr] (scaled, fp32); latent [L, R], k_rope [L, Dr]; valid bool[Q, L] ->
    latent output fp32 [Q, H, R]."""
    # keys no query may read can be garbage (other rows' pages, never-written NaN pages): zero them, not just mask
    readable = valid.any(axis=0)[:, None]
    latent = jnp.where(readable, latent, jnp.zeros((), latent.dtype))
    k_rope = jnp.where(readable, k_rope, jnp.zeros((), k_rope.dtype))
    precision = _HIGHEST if latent.dtype == jnp.float32 else None
    scores = (jnp.einsum("qhr,lr->qhl", q_latent.astype(latent.dtype), latent, precision=precision,
                         preferred_element_type=jnp.float32)
              + jnp.einsum("qhd,ld->qhl", q_rope.astype(k_rope.dtype), k_rope, precision=precision,
                           preferred_element_type=jnp.float32))
    probs = jax.nn.softmax(jnp.where(valid[:, None, :], scores, -jnp.inf), axis=-1)
    return jnp.einsum("qhl,lr->qhr", probs.astype(latent.dtype), latent, precision=precision,
                      preferred_element_type=jnp.float32)


def paged_latent_attention(q_latent, q_rope, latent, k_rope, meta: StepMetadata, pools, *, block_size: int,
                           query_tile: int = 64):
    """Writes this step's latent and rope key to the pages named by the block tables (padding tokens write nothing),
    then each query token attends over its row's pages up to its own position.

    q_latent [T, H, R], q_rope [T, H, Dr] (absorbed and scaled, fp32); latent [T, R], k_rope [T, Dr]; pools
    (latent_pages [P, block_size, 1, R], rope_pages [P, block_size, 1, Dr]). Returns (latent output fp32 [T, H, R],
    pools).
    """
    latent_pages, rope_pages = pools
    num_tokens = q_latent.shape[0]
    cu = meta.cu_seqlens
    num_rows = cu.shape[0] - 1
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    rows = jnp.clip(searchsorted(jnp, cu[1:], token, side="right"), 0, num_rows - 1).astype(jnp.int32)
    positions = meta.positions
    page = jnp.where(token < cu[num_rows], meta.block_tables[rows, positions // block_size], latent_pages.shape[0])
    within = positions % block_size
    latent_pages = latent_pages.at[page, within, 0].set(latent.astype(latent_pages.dtype), mode="drop")
    rope_pages = rope_pages.at[page, within, 0].set(k_rope.astype(rope_pages.dtype), mode="drop")
    span = meta.block_tables.shape[1] * block_size
    keys = jnp.arange(span)

    def gathered(row):  # the row's pages as [span, R], [span, Dr]
        pages = meta.block_tables[row]
        return (latent_pages[pages].reshape(span, latent_pages.shape[-1]),
                rope_pages[pages].reshape(span, rope_pages.shape[-1]))

    def one_token(ql, qr, row, pos):
        return _latent_scores(ql[None], qr[None], *gathered(row), (keys <= pos)[None])[0]

    def tile(args):
        ql, qr, row, pos = args  # [Q, H, R], [Q, H, Dr], i32[Q], i32[Q]
        # a tile inside one row gathers its pages once; a tile across rows gathers per token
        return jax.lax.cond(row[0] == row[-1],
                            lambda: _latent_scores(ql, qr, *gathered(row[0]), keys[None, :] <= pos[:, None]),
                            lambda: jax.vmap(one_token)(ql, qr, row, pos))

    pad = -num_tokens % query_tile
    # padding queries repeat the last token's row and position, so they never make a tile straddle rows
    tiles = [jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)]).reshape(-1, query_tile, *a.shape[1:])
             for a in (q_latent, q_rope, rows, positions)]
    out = jax.lax.map(tile, tiles).reshape(num_tokens + pad, *q_latent.shape[1:])[:num_tokens]
    return out, (latent_pages, rope_pages)
