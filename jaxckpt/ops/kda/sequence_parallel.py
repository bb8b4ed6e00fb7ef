"""Kimi Delta Attention (KDA), sequence-parallel: long rows cut into pieces that one call of the Pallas Triton kernels
(or the XLA chunked path) runs in parallel, joined by composing the pieces' affine state maps. The gate is computed
once in plain jnp (`xla.kda_gate`) before the pieces. The algorithm is in `jaxckpt/ops/common/sequence_parallel.py`,
the math and its rounding class in `jaxckpt/ops/common/README.md`."""

from __future__ import annotations

from jaxckpt.ops.common import sequence_parallel as sp
from jaxckpt.ops.common.delta_backend import gate_reason
from jaxckpt.ops.common.delta_chunk import check_static


def _pallas_supports(q, k, v, g, beta, **options):
    from jaxckpt.ops.kda import pallas_triton

    return pallas_triton.supports(q, k, v, g, beta, **options)


def _bases():
    from jaxckpt.ops.kda import pallas_triton, xla

    return {"pallas_triton": pallas_triton.kda, "xla": xla.kda}


def supports(q, k, v, g, beta, *, chunk_size=64, **options) -> str | None:
    """None when `kda` can run these inputs and options here, else the reason."""
    return gate_reason(q, g, per_channel_decay=True) or sp.resolve(
        q, k, v, g, beta, chunk_size=chunk_size, options=options, pallas_supports=_pallas_supports)[1]


def differentiable(q, k, v, g, beta, *, chunk_size=64, **options) -> bool:
    """True with the XLA base (`sequence_parallel.differentiable`)."""
    return sp.differentiable(q, k, v, g, beta, chunk_size=chunk_size, options=options,
                             pallas_supports=_pallas_supports)


def kda(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", A_log=None, dt_bias=None, lower_bound=None,
        chunk_size=64, **options):
    """Kimi Delta Attention, sequence-parallel over long rows.

    Arguments, shapes and results as `jaxckpt.ops.kda.xla.kda` (g is the raw gate with A_log / dt_bias /
    lower_bound); options as `jaxckpt.ops.gdn.sequence_parallel.gated_delta_rule`.
    """
    from jaxckpt.ops.kda.xla import kda_gate

    check_static(q, k, v, g, beta, per_channel_decay=True, scale=scale, initial_state=initial_state,
                 cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                 state_layout=state_layout, chunk_size=chunk_size, checkpoint_method="in_chunk")
    choice, reason = sp.resolve(q, k, v, g, beta, chunk_size=chunk_size, options=options,
                                pallas_supports=_pallas_supports)
    if reason is not None:
        raise ValueError(reason)
    g = kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return sp.run_delta(_bases(), q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm,
                        initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                        checkpoint_offsets=checkpoint_offsets, state_layout=state_layout, chunk_size=chunk_size,
                        choice=choice)
