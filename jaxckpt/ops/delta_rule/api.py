"""Public entries of the gated delta rule, GDN (`gated_delta_rule`) and KDA (`kda`): `implementation=` and `config=`,
batched or packed inputs, decode rows, paged pools."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from jaxckpt.ops.common.api import flatten_batch, run, run_paged, unflatten
from jaxckpt.ops.common.configs import DELTA_CONFIGS
from jaxckpt.ops.common.recurrent_step import delta_rule_step

MODULES = MappingProxyType({
    "reference": "jaxckpt.ops.delta_rule.reference",
    "xla": "jaxckpt.ops.delta_rule.xla",
    "pallas_triton": "jaxckpt.ops.delta_rule.pallas_triton",
    "pallas_mosaic_gpu": "jaxckpt.ops.delta_rule.pallas_mosaic_gpu.pipeline",
    "sequence_parallel": "jaxckpt.ops.delta_rule.sequence_parallel",
})
GDN_REGISTRY = MappingProxyType({name: f"{module}:gated_delta_rule" for name, module in MODULES.items()})
KDA_REGISTRY = MappingProxyType({name: f"{module}:kda" for name, module in MODULES.items()})


def prepare_delta(q, k, v, g, beta, cu_seqlens, *, options: Mapping[str, object], chunk_size: int,
                  implementation, checkpoint_method: str, num_decodes: int, config, decode_step: Callable):
    """Flattens [B, T, ...] inputs and bundles what `common.api.run` needs: (arrays, cu_seqlens, batch, run options)."""
    (q, k, v, g, beta), cu_seqlens, batch = flatten_batch([q, k, v, g, beta], cu_seqlens, packed_ndim=3, name="q")
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta)
    head_k, (num_v_heads, head_v) = q.shape[-1], v.shape[1:]
    layout = options.get("state_layout", "kv")
    shape = (num_v_heads, head_k, head_v) if layout == "kv" else (num_v_heads, head_v, head_k)
    run_options = dict(implementation=implementation, checkpoint_method=checkpoint_method, num_decodes=num_decodes,
                       decode_step=decode_step, state_shape=shape, chunk_size=chunk_size, configs=DELTA_CONFIGS,
                       config=config)
    return arrays, cu_seqlens, batch, run_options


def gated_delta_rule(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
                     checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", implementation=None,
                     checkpoint_method="in_chunk", num_decodes=0, chunk_size=64, config=None):
    """Gated DeltaNet over packed varlen rows, exporting the state at every checkpoint in the same pass.

    q, k            # [T, H, K]; or [B, T, H, K] with cu_seqlens=None (B rows of length T); or [1, T, H, K] with
                    # cu_seqlens (FLA's varlen form); the output takes the same leading shape
    v               # [T, HV, V]; HV a multiple of H (value head h reads key head h // (HV // H))
    g               # [T, HV] log decay (<= 0)
    beta            # [T, HV]
    initial_state   # [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk"); None = zeros
    cu_seqlens      # i32[N + 1]; checkpoint_cu i32[N + 1] + checkpoint_offsets i32[M]: CSR, query-relative offsets

    `implementation`: "reference" (float64 numpy), "xla", "pallas_triton", "pallas_mosaic_gpu" (Hopper; tried first
    by None), "sequence_parallel" (long rows cut into pieces joined by their affine state maps), or None for the
    fastest that supports the call here (never "sequence_parallel": name it or its config).
    `config`: the tuning of one implementation, which it then runs (`jaxckpt.ops.XlaConfig`,
    `DeltaPallasTritonConfig`, `DeltaPallasMosaicGpuConfig`, `SequenceParallelConfig`); None: its defaults.
    `checkpoint_method`: "in_chunk" (fixed chunk grid; outputs bitwise unchanged by checkpoints), "forced_break" (a
    chunk starts at every checkpoint; "xla" only: the kernels decline it, so None picks "xla") or "split" (launch j
    runs segment j of every row; host metadata). The first `num_decodes` rows must be single tokens; they skip the
    chunk machinery.
    Returns (o [T, HV, V], final_state fp32 [N, ...], checkpoint_states fp32 [M, ...]; M = 0 without checkpoints).
    """
    options = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, state_layout=state_layout)
    arrays, cu_seqlens, batch, run_options = prepare_delta(
        q, k, v, g, beta, cu_seqlens, options=options, chunk_size=chunk_size, implementation=implementation,
        checkpoint_method=checkpoint_method, num_decodes=num_decodes, config=config,
        decode_step=delta_rule_step)
    o, final, ckpt = run(GDN_REGISTRY, arrays, options, initial_state=initial_state, cu_seqlens=cu_seqlens,
                         checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, **run_options)
    return unflatten(o, batch), final, ckpt


def gated_delta_rule_paged(q, k, v, g, beta, state_pool, *, initial_state_indices, has_initial_state,
                           final_state_indices, checkpoint_state_indices=None, scale=None, use_qk_l2norm=False,
                           cu_seqlens=None, checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv",
                           implementation=None, checkpoint_method="in_chunk", num_decodes=0, chunk_size=64,
                           config=None, donate=True):
    """`gated_delta_rule` over a paged state pool [S, HV, K, V] (fp32 or bf16): returns (o, state_pool).

    initial_state_indices, has_initial_state, final_state_indices  # i32[N], bool[N], i32[N]
    checkpoint_state_indices                                       # i32[M] (padded entries: the null slot)
    Slot 0 is the null slot: never read as a real state, never written. The pool is donated (`donate=True`).
    """
    options = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, state_layout=state_layout)
    arrays, cu_seqlens, batch, run_options = prepare_delta(
        q, k, v, g, beta, cu_seqlens, options=options, chunk_size=chunk_size, implementation=implementation,
        checkpoint_method=checkpoint_method, num_decodes=num_decodes, config=config,
        decode_step=delta_rule_step)
    o, pool = run_paged(GDN_REGISTRY, arrays, options, state_pool, initial_state_indices=initial_state_indices,
                        has_initial_state=has_initial_state, final_state_indices=final_state_indices,
                        checkpoint_state_indices=checkpoint_state_indices, cu_seqlens=cu_seqlens,
                        checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, donate=donate,
                        **run_options)
    return unflatten(o, batch), pool


def _decode_step(q, k, v, g, beta, *, initial_state=None, A_log=None, dt_bias=None, lower_bound=None, **options):
    from jaxckpt.ops.delta_rule.gate import kda_gate

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
    o, final, ckpt = run(KDA_REGISTRY, arrays, options, initial_state=initial_state, cu_seqlens=cu_seqlens,
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
    o, pool = run_paged(KDA_REGISTRY, arrays, options, state_pool, initial_state_indices=initial_state_indices,
                        has_initial_state=has_initial_state, final_state_indices=final_state_indices,
                        checkpoint_state_indices=checkpoint_state_indices, cu_seqlens=cu_seqlens,
                        checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, donate=donate,
                        **run_options)
    return unflatten(o, batch), pool
