"""Inputs and Triton reference launches shared by the Mosaic GPU intra-chunk kernel tests (GDN and KDA): fp32 numpy
inputs as the layers feed them (l2-normalized q and k), the chunk layout and gate cumsum `delta_rule` builds, and the
Triton intra passes the Mosaic GPU kernels are compared with."""

from __future__ import annotations

import numpy as np

OUTPUTS = ("w", "u", "kd", "qg", "aqk")
CHUNK = 64


def _unit_qk(rng, num_tokens, num_heads, head_k):
    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    return (unit(rng.normal(size=(num_tokens, num_heads, head_k))).astype(np.float32),
            unit(rng.normal(size=(num_tokens, num_heads, head_k))).astype(np.float32))


def make_gdn_inputs(rng, num_tokens, num_heads, num_v_heads, head_k, head_v):
    """fp32 numpy q, k (l2-normalized per token), v, g (log decays <= 0, a few strong ones) and beta in (0, 1)."""
    g_shape = (num_tokens, num_v_heads)
    g = -rng.exponential(0.3, size=g_shape) - np.where(rng.random(g_shape) < 0.05, 4.0, 0.0)
    q, k = _unit_qk(rng, num_tokens, num_heads, head_k)
    return dict(q=q, k=k, v=rng.normal(size=(num_tokens, num_v_heads, head_v)).astype(np.float32),
                g=g.astype(np.float32), beta=rng.uniform(0.05, 0.95, size=g_shape).astype(np.float32))


def make_kda_inputs(rng, num_tokens, num_heads, num_v_heads, head_k, head_v, *, strong=False):
    """fp32 numpy q, k (l2-normalized per token), v, per-channel log decays g [T, HV, K] <= 0 and beta in (0, 1).

    Default decays: mostly mild, a few strong channels. strong=True: every channel decays by 3 to 6 per token, with
    -30 spikes, so a chunk's G falls far below -88 (exp(-G) overflows fp32) and many factors underflow.
    """
    g_shape = (num_tokens, num_v_heads, head_k)
    if strong:
        g = -rng.uniform(3.0, 6.0, size=g_shape) - np.where(rng.random(g_shape) < 0.02, 30.0, 0.0)
    else:
        g = -rng.exponential(0.1, size=g_shape) - np.where(rng.random(g_shape) < 0.03, 3.0, 0.0)
    q, k = _unit_qk(rng, num_tokens, num_heads, head_k)
    return dict(q=q, k=k, v=rng.normal(size=(num_tokens, num_v_heads, head_v)).astype(np.float32),
                g=g.astype(np.float32),
                beta=rng.uniform(0.05, 0.95, size=(num_tokens, num_v_heads)).astype(np.float32))


def raw_keys(rng, x, *, norms=(1e-3, 1e3), parallel=0.9):
    """x's keys made raw, in place: norms log-uniform over `norms`, each token's key `parallel`-correlated with
    its head's common direction (near-parallel keys: the inverse's worst case), and beta = beta' / |k|^2 with beta'
    in (0.05, 2], so every transition I - beta k k^T stays contractive, as in a model with unnormalized keys."""
    k = x["k"]
    common = k[:1] / np.linalg.norm(k[:1], axis=-1, keepdims=True)
    unit = parallel * common + np.sqrt(1 - parallel ** 2) * k
    unit /= np.linalg.norm(unit, axis=-1, keepdims=True)
    norms = np.exp(rng.uniform(*np.log(norms), size=k.shape[:2]))  # [T, H]
    x["k"] = (unit * norms[..., None]).astype(np.float32)
    group = x["beta"].shape[1] // k.shape[1]
    beta_eff = rng.uniform(0.05, 2.0, size=x["beta"].shape)
    x["beta"] = (beta_eff / np.repeat(norms, group, axis=1) ** 2).astype(np.float32)
    return x


def raw_rows(rng, x, *, norms):
    """x's q and k rows scaled, in place, to norms log-uniform over `norms` (inputs for `use_qk_l2norm`)."""
    for name in ("q", "k"):
        x[name] *= np.exp(rng.uniform(*np.log(norms), size=(*x[name].shape[:2], 1))).astype(np.float32)
    return x


def layout(cu_seqlens, num_tokens, chunk=CHUNK):
    """chunk_start, chunk_len (i32[NC]) of packed rows, as `delta_rule` builds them (no checkpoints)."""
    import jax.numpy as jnp

    from jaxckpt.plan.layout import chunk_layout

    rows = len(cu_seqlens) - 1
    lay = chunk_layout(jnp.asarray(cu_seqlens, jnp.int32), jnp.zeros(rows + 1, jnp.int32), jnp.zeros(0, jnp.int32),
                       chunk_size=chunk, num_tokens=num_tokens, xp=jnp)
    return lay.chunk_start, lay.chunk_len


def gate_cumsum(chunk_start, chunk_len, g, *, chunk=CHUNK, interpret=False):
    """G = fp32 [HV, NC, C], the gate cumsum launch of the delta rule's kernel pipelines."""
    import jax.numpy as jnp

    from jaxckpt.ops.delta_rule import cumsum

    return cumsum.gate_cumsum(chunk_start, chunk_len, g.astype(jnp.float32), per_channel_decay=False, chunk=chunk,
                              interpret=interpret)


def triton_intra(chunk_start, chunk_len, q, k, v, beta, G, *, group, scale, chunk=CHUNK, interpret=False,
                 num_warps=4):
    """(w, u, kd, qg, aqk) of the Triton GDN intra launch (`delta_rule.pallas_triton.gdn_intra`), q and k cast to the
    I/O dtype as `delta_rule` casts them."""
    import jax.numpy as jnp

    from jaxckpt.ops.delta_rule import pallas_triton as ptd

    io_dtype = jnp.promote_types(k.dtype, v.dtype)
    io_dtype = jnp.float32 if io_dtype.itemsize >= 4 else io_dtype
    return ptd.gdn_intra(chunk_start, chunk_len, q.astype(io_dtype), k.astype(io_dtype), v, beta, G, chunk=chunk,
                         group=group, scale=float(scale), interpret=interpret, num_warps=num_warps)


def prepared(x, cu_seqlens, dtype, *, interpret=False):
    """`delta_rule.cumsum.prepare` of the KDA inputs x (q, k, v in `dtype`): layout, casts and G [HV, NC, C, K]."""
    import jax.numpy as jnp

    from jaxckpt.ops.delta_rule import cumsum

    q, k, v = (jnp.asarray(x[name], dtype) for name in ("q", "k", "v"))
    return cumsum.prepare(q, k, v, jnp.asarray(x["g"]), jnp.asarray(x["beta"]), per_channel_decay=True, scale=None,
                          use_qk_l2norm=False, cu_seqlens=jnp.asarray(cu_seqlens, jnp.int32), checkpoint_cu=None,
                          checkpoint_offsets=None, chunk_size=CHUNK, interpret=interpret)


def triton_kda_intra(p, q, k, v, beta, G, *, interpret=False):
    """(w, u, kd, qg, aqk) of the Triton KDA intra launches (`intra_v2`, default "split") on p's layout."""
    from jaxckpt.ops.delta_rule import pallas_triton as ptd

    return ptd.intra_v2(p._replace(q=q, k=k, v=v, beta=beta, G=G), per_channel_decay=True, chunk_size=CHUNK,
                        interpret=interpret)


def mosaic_kda_intra(p, q, k, v, beta, g, *, checkpoint_count=None, interpret=False, **tuning):
    """(w, u, kd, qg, aqk, G_last, G at checkpoint chunks or None) of the Mosaic GPU kernel on p's layout, from the
    raw gate g [T, HV, K]."""
    from jaxckpt.ops.delta_rule.pallas_mosaic_gpu.kda_intra import kda_intra

    return kda_intra(p.lay.chunk_start, p.lay.chunk_len, q, k, v, beta, g, chunk=CHUNK, group=v.shape[1] // q.shape[1],
                     scale=p.scale, checkpoint_count=checkpoint_count, interpret=interpret, **tuning)
