"""What every GDN / KDA kernel entry does around its pipeline: the gate's shape, the static checks, the backend's
decline reason raised as a ValueError, KDA's gate in plain jnp before the kernels."""

from __future__ import annotations

from collections.abc import Callable

from jaxckpt.ops.common.delta_chunk import check_static


def gate_reason(q, g, *, per_channel_decay: bool) -> str | None:
    """None when g has the op's shape: [T, HV] for GDN, [T, HV, K] for KDA (`per_channel_decay`)."""
    if per_channel_decay:
        if g.ndim != 3 or g.shape[-1] != q.shape[-1]:
            return f"g: expected [T, HV, K] for KDA, got shape {g.shape}"
    elif g.ndim != 2:
        return f"g: expected [T, HV] for GDN, got shape {g.shape}"
    return None


def run_checked(pipeline: Callable, supports: Callable, q, k, v, g, beta, *, per_channel_decay: bool, scale,
                use_qk_l2norm, initial_state, cu_seqlens, checkpoint_cu, checkpoint_offsets, state_layout,
                chunk_size, interpret, gate: Callable | None = None, **tuning):
    """`pipeline(q, k, v, g, beta, ...)` after the static checks and `supports` (whose reason raises a ValueError);
    `gate` maps the raw g to the log decay first (KDA's fused gate)."""
    check_static(q, k, v, g, beta, per_channel_decay=per_channel_decay, scale=scale, initial_state=initial_state,
                 cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                 state_layout=state_layout, chunk_size=chunk_size, checkpoint_method="in_chunk",
                 state_pass="sequential")
    reason = supports(q, k, v, g, beta, chunk_size=chunk_size, interpret=interpret, **tuning)
    if reason is not None:
        raise ValueError(reason)
    if gate is not None:
        g = gate(g)
    return pipeline(q, k, v, g, beta, per_channel_decay=per_channel_decay, scale=scale, use_qk_l2norm=use_qk_l2norm,
                    initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                    checkpoint_offsets=checkpoint_offsets, state_layout=state_layout, chunk_size=chunk_size,
                    interpret=interpret, **tuning)
