"""Float64 token-by-token reference of the gated delta rule (GDN): the ground truth every GDN implementation is tested
against. The math, state layout and checkpoint semantics are in README.md beside this file."""

from __future__ import annotations

from jaxckpt.ops.common.delta_reference import delta_rule_reference


def gated_delta_rule(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
                     checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv"):
    """Gated delta rule with a scalar log decay per token and value head, in float64.

    q, k                # [T, H, K]; optionally L2-normalized here (`use_qk_l2norm`); q is multiplied by `scale`
                        # (default K**-0.5)
    v                   # [T, HV, V]; HV a multiple of H, value head h reads key head h // (HV // H)
    g                   # [T, HV] log decay (<= 0 expected, not enforced)
    beta                # [T, HV]
    initial_state       # [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk"); None = zeros
    cu_seqlens          # i32[N + 1]; None = one row over all T tokens
    checkpoint_cu       # i32[N + 1], CSR with checkpoint_offsets i32[M] (offsets relative to the row start)
    Inputs may be float16, bfloat16, float32 or float64; everything is computed in float64.

    Returns (o [T, HV, V], final_state [N, HV, K, V] or [N, HV, V, K], checkpoint_states [M, HV, K, V] or
    [M, HV, V, K]), float64 numpy. The checkpoint at offset p is the state after the row's first p tokens; padded
    checkpoint entries and padding tokens give zeros.
    """
    return delta_rule_reference(q, k, v, g, beta, per_channel_decay=False, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                                checkpoint_offsets=checkpoint_offsets, state_layout=state_layout)
