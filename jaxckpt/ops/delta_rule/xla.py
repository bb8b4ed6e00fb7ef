"""The gated delta rule (GDN and KDA), chunk-parallel in plain jnp/lax: the portable implementation, differentiable,
jit-friendly with traced varlen and checkpoint metadata. The algorithm and its performance
notes are in `chunk.py`, the math and the gate in README.md beside this file."""

from __future__ import annotations

import functools

import jax

from jaxckpt.ops.delta_rule.chunk import check_static, chunked_delta_rule
from jaxckpt.ops.delta_rule.gate import kda_gate

_STATIC = ("scale", "use_qk_l2norm", "state_layout", "chunk_size", "checkpoint_method", "state_pass")


def differentiable(**call) -> bool:
    """Plain jnp/lax: JAX differentiates through every call (`jaxckpt.ops.common.api` wraps the kernels that it
    cannot)."""
    return True


@functools.partial(jax.jit, static_argnames=_STATIC)
def gated_delta_rule(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
                     checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", chunk_size=64,
                     checkpoint_method="in_chunk", state_pass="associative"):
    """Gated delta rule with a scalar log decay per token and value head, exporting checkpoint states.

    q, k                # [T, H, K]; optionally L2-normalized (`use_qk_l2norm`); q is multiplied by `scale`
                        # (a Python number, default K**-0.5)
    v                   # [T, HV, V]; HV a multiple of H, value head h reads key head h // (HV // H)
    g                   # [T, HV] log decay (<= 0)
    beta                # [T, HV]
    initial_state       # [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk"), any float dtype; None = zeros
    cu_seqlens          # i32[N + 1]; None = one row over all T tokens
    checkpoint_cu       # i32[N + 1], CSR with checkpoint_offsets i32[M] (offsets relative to the row start)
    The metadata arrays may be traced; their values are trusted (validate them with `jaxckpt.plan.conventions`).
    `chunk_size`: tokens per chunk; `checkpoint_method`: "in_chunk" (fixed chunk grid, checkpoints read inside their
    chunk) or "forced_break" (a chunk starts at every checkpoint); `state_pass`: "associative" (a parallel prefix scan
    over the chunks' affine state maps, the fast default on GPUs) or "sequential" (one `lax.scan` step per chunk).
    Precision follows q, k, v: all 16-bit takes bf16 tensor-core products (rel-RMS <= 6e-3 against float64), otherwise
    every matmul runs at fp32 HIGHEST (<= 1e-5).

    Returns (o [T, HV, V] in v.dtype, final_state fp32 [N, HV, K, V] or [N, HV, V, K], checkpoint_states fp32
    [M, HV, K, V] or [M, HV, V, K]); the checkpoint at offset p is the state after the row's first p tokens.
    Padding tokens and padded checkpoint entries give zeros.
    """
    check_static(q, k, v, g, beta, per_channel_decay=False, scale=scale, initial_state=initial_state,
                 cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                 state_layout=state_layout, chunk_size=chunk_size, checkpoint_method=checkpoint_method,
                 state_pass=state_pass)
    return chunked_delta_rule(q, k, v, g[..., None], beta, scale=scale, use_qk_l2norm=use_qk_l2norm,
                              initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                              checkpoint_offsets=checkpoint_offsets, state_layout=state_layout,
                              chunk_size=chunk_size, checkpoint_method=checkpoint_method, state_pass=state_pass)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "lower_bound"))
def kda(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", A_log=None, dt_bias=None, lower_bound=None,
        chunk_size=64, checkpoint_method="in_chunk", state_pass="associative"):
    """Kimi Delta Attention: the gated delta rule with a log decay per token, value head and key channel.

    Arguments, options, precision and results as `gated_delta_rule`, except g [T, HV, K]: the raw
    gate, turned into the log decay by `kda_gate` (A_log [HV], dt_bias [HV, K] or [HV * K], lower_bound).
    """
    check_static(q, k, v, g, beta, per_channel_decay=True, scale=scale, initial_state=initial_state,
                 cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                 state_layout=state_layout, chunk_size=chunk_size, checkpoint_method=checkpoint_method,
                 state_pass=state_pass)
    g = kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return chunked_delta_rule(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm,
                              initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                              checkpoint_offsets=checkpoint_offsets, state_layout=state_layout,
                              chunk_size=chunk_size, checkpoint_method=checkpoint_method, state_pass=state_pass)
