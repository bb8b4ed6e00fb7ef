"""Public entry of the gated delta rule: `implementation=` and `config=`, batched or packed inputs, decode rows,
paged pools."""

from __future__ import annotations

from types import MappingProxyType

from jaxckpt.ops.common.api import run, run_paged, unflatten
from jaxckpt.ops.common.delta_api import prepare_delta
from jaxckpt.ops.common.recurrent_step import delta_rule_step

REGISTRY = MappingProxyType({
    "reference": "jaxckpt.ops.gdn.reference:gated_delta_rule",
    "xla": "jaxckpt.ops.gdn.xla:gated_delta_rule",
    "pallas_triton": "jaxckpt.ops.gdn.pallas_triton:gated_delta_rule",
    "pallas_mosaic_gpu": "jaxckpt.ops.gdn.pallas_mosaic_gpu:gated_delta_rule",
    "sequence_parallel": "jaxckpt.ops.gdn.sequence_parallel:gated_delta_rule",
})


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
    o, final, ckpt = run(REGISTRY, arrays, options, initial_state=initial_state, cu_seqlens=cu_seqlens,
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
    o, pool = run_paged(REGISTRY, arrays, options, state_pool, initial_state_indices=initial_state_indices,
                        has_initial_state=has_initial_state, final_state_indices=final_state_indices,
                        checkpoint_state_indices=checkpoint_state_indices, cu_seqlens=cu_seqlens,
                        checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, donate=donate,
                        **run_options)
    return unflatten(o, batch), pool
