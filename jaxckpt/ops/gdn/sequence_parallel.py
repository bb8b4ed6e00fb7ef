"""Gated DeltaNet (GDN), sequence-parallel: long rows cut into pieces that one call of the Pallas Triton kernels (or
the XLA chunked path) runs in parallel, joined by composing the pieces' affine state maps. The algorithm is in
`jaxckpt/ops/common/sequence_parallel.py`, the math and its rounding class in `jaxckpt/ops/common/README.md`."""

from __future__ import annotations

from jaxckpt.ops.common import sequence_parallel as sp
from jaxckpt.ops.common.delta_backend import gate_reason
from jaxckpt.ops.common.delta_chunk import check_static


def _pallas_supports(q, k, v, g, beta, **options):
    from jaxckpt.ops.gdn import pallas_triton

    return pallas_triton.supports(q, k, v, g, beta, **options)


def _bases():
    from jaxckpt.ops.gdn import pallas_triton, xla

    return {"pallas_triton": pallas_triton.gated_delta_rule, "xla": xla.gated_delta_rule}


def supports(q, k, v, g, beta, *, chunk_size=64, **options) -> str | None:
    """None when `gated_delta_rule` can run these inputs and options here, else the reason."""
    return gate_reason(q, g, per_channel_decay=False) or sp.resolve(
        q, k, v, g, beta, chunk_size=chunk_size, options=options, pallas_supports=_pallas_supports)[1]


def differentiable(q, k, v, g, beta, *, chunk_size=64, **options) -> bool:
    """True with the XLA base (`sequence_parallel.differentiable`)."""
    return sp.differentiable(q, k, v, g, beta, chunk_size=chunk_size, options=options,
                             pallas_supports=_pallas_supports)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
                     checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", chunk_size=64, **options):
    """Gated delta rule with a scalar log decay per token and value head, sequence-parallel over long rows.

    Arguments, shapes and results as `jaxckpt.ops.gdn.xla.gated_delta_rule` (metadata may be traced). Options (all
    static): base ("pallas_triton" | "xla" | None = Pallas where it supports the widened call), piece_len (tokens
    per piece; None = from the shape, `sequence_parallel.choose_piece_len`, which also falls back to the plain base
    call where pieces do not pay), target_programs, min_piece_len, piece_cuts ("checkpoints" | "snap" | "grid"),
    compose ("associative" | "sequential"), correction ("pallas" | "xla"), interpret (Pallas on CPU); any other
    option goes to the base (Pallas tuning, or the XLA path's state_pass).
    """
    check_static(q, k, v, g, beta, per_channel_decay=False, scale=scale, initial_state=initial_state,
                 cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                 state_layout=state_layout, chunk_size=chunk_size, checkpoint_method="in_chunk")
    choice, reason = sp.resolve(q, k, v, g, beta, chunk_size=chunk_size, options=options,
                                pallas_supports=_pallas_supports)
    if reason is not None:
        raise ValueError(reason)
    return sp.run_delta(_bases(), q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm,
                        initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                        checkpoint_offsets=checkpoint_offsets, state_layout=state_layout, chunk_size=chunk_size,
                        choice=choice)
