"""Public entry of Kimi Delta Attention: `implementation=` and `config=`, batched or packed inputs, decode rows,
paged pools."""

from __future__ import annotations

from types import MappingProxyType

from jaxckpt.ops.common.api import run, run_paged, unflatten
from jaxckpt.ops.common.delta_api import prepare_delta
from jaxckpt.ops.common.recurrent_step import delta_rule_step

REGISTRY = MappingProxyType({
    "reference": "jaxckpt.ops.kda.reference:kda",
    "xla": "jaxckpt.ops.kda.xla:kda",
    "pallas_triton": "jaxckpt.ops.kda.pallas_triton:kda",
    "pallas_mosaic_gpu": "jaxckpt.ops.kda.pallas_mosaic_gpu:kda",
    "sequence_parallel": "jaxckpt.ops.kda.sequence_parallel:kda",
})


def _decode_step(q, k, v, g, beta, *, initial_state=None, A_log=None, dt_bias=None, lower_bound=None, **options):
    from jaxckpt.ops.kda.xla import kda_gate

    g = kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return delta_rule_step(q, k, v, g, beta, initial_state=initial_state, **options)


def _prepare(q, k, v, g, beta, cu_seqlens, options, chunk_size, implementation, checkpoint_method, num_decodes,
             config):
    return prepare_delta(q, k, v, g, beta, cu_seqlens, options=options, chunk_size=chunk_size,
                         implementation=implementation, checkpoint_method=checkpoint_method, num_decodes=num_decodes,
                         config=config, decode_step=_decode_step)


def kda(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None, checkpoint_cu=None,
        checkpoint_offsets=None, state_layout="kv", A_log=None, dt_bias=None, lower_bound=None, implementation=None,
        checkpoint_method="in_chunk", num_decodes=0, chunk_size=64, config=None):
    """Kimi Delta Attention: the gated delta rule with a log decay per key channel.

    g               # [T, HV, K]: the log decay, or with `A_log` ([HV]) the raw gate input of the fused gate
                    # -exp(A_log) * softplus(g + dt_bias); with `lower_bound` the bounded gate
                    # lower_bound * sigmoid(exp(A_log) * (g + dt_bias)); dt_bias [HV, K] or [HV * K]
    Everything else as `jaxckpt.ops.gated_delta_rule` (shapes, checkpoints, implementations, decode rows).
    """
    options = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, state_layout=state_layout, A_log=A_log, dt_bias=dt_bias,
                   lower_bound=lower_bound)
    arrays, cu_seqlens, batch, run_options = _prepare(q, k, v, g, beta, cu_seqlens, options, chunk_size,
                                                      implementation, checkpoint_method, num_decodes, config)
    o, final, ckpt = run(REGISTRY, arrays, options, initial_state=initial_state, cu_seqlens=cu_seqlens,
                         checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, **run_options)
    return unflatten(o, batch), final, ckpt


def kda_paged(q, k, v, g, beta, state_pool, *, initial_state_indices, has_initial_state, final_state_indices,
              checkpoint_state_indices=None, scale=None, use_qk_l2norm=False, cu_seqlens=None, checkpoint_cu=None,
              checkpoint_offsets=None, state_layout="kv", A_log=None, dt_bias=None, lower_bound=None,
              implementation=None, checkpoint_method="in_chunk", num_decodes=0, chunk_size=64, config=None,
              donate=True):
    """`kda` over a paged state pool, as `jaxckpt.ops.gated_delta_rule_paged`: returns (o, state_pool)."""
    options = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, state_layout=state_layout, A_log=A_log, dt_bias=dt_bias,
                   lower_bound=lower_bound)
    arrays, cu_seqlens, batch, run_options = _prepare(q, k, v, g, beta, cu_seqlens, options, chunk_size,
                                                      implementation, checkpoint_method, num_decodes, config)
    o, pool = run_paged(REGISTRY, arrays, options, state_pool, initial_state_indices=initial_state_indices,
                        has_initial_state=has_initial_state, final_state_indices=final_state_indices,
                        checkpoint_state_indices=checkpoint_state_indices, cu_seqlens=cu_seqlens,
                        checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, donate=donate,
                        **run_options)
    return unflatten(o, batch), pool
