"""Public entry of the causal depthwise conv1d: batched or packed inputs, conv-state checkpoints, paged pools."""

from __future__ import annotations

from types import MappingProxyType

from jaxckpt.ops.common.api import flatten_batch, run, run_paged, unflatten

REGISTRY = MappingProxyType({
    "reference": "jaxckpt.ops.conv1d.reference:causal_conv1d",
    "xla": "jaxckpt.ops.conv1d.xla:causal_conv1d",
})


def _prepare(x, weight, bias, activation, cu_seqlens, implementation):
    (x,), cu_seqlens, batch = flatten_batch([x], cu_seqlens, packed_ndim=2, name="x")
    options = dict(weight=weight, bias=bias, activation=activation)
    run_options = dict(implementation=implementation, checkpoint_method="in_chunk", num_decodes=0, decode_step=None,
                       state_shape=(x.shape[-1], weight.shape[-1] - 1), chunk_size=None)
    return dict(x=x), options, cu_seqlens, batch, run_options


def causal_conv1d(x, weight, bias=None, *, activation="silu", initial_state=None, cu_seqlens=None, checkpoint_cu=None,
                  checkpoint_offsets=None, implementation=None):
    """Depthwise causal conv over packed rows; the state is the last W - 1 raw inputs, [N, D, W - 1] oldest first.

    x               # [T, D]; or [B, T, D] with cu_seqlens=None; or [1, T, D] with cu_seqlens (FLA's varlen form)
    weight          # [D, W], W in 2..4; bias [D]; activation None or "silu"
    The checkpoint at offset p is the W - 1 raw inputs before p (from the incoming state near the row start): exact
    copies in x's dtype. Returns (y [T, D], final_state [N, D, W - 1], checkpoint_states [M, D, W - 1]).
    """
    arrays, options, cu_seqlens, batch, run_options = _prepare(x, weight, bias, activation, cu_seqlens,
                                                               implementation)
    y, final, ckpt = run(REGISTRY, arrays, options, initial_state=initial_state, cu_seqlens=cu_seqlens,
                         checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, **run_options)
    return unflatten(y, batch), final, ckpt


def causal_conv1d_paged(x, weight, state_pool, bias=None, *, initial_state_indices, has_initial_state,
                        final_state_indices, checkpoint_state_indices=None, activation="silu", cu_seqlens=None,
                        checkpoint_cu=None, checkpoint_offsets=None, implementation=None, donate=True):
    """`causal_conv1d` over a paged conv-state pool [S, D, W - 1]: returns (y, state_pool)."""
    arrays, options, cu_seqlens, batch, run_options = _prepare(x, weight, bias, activation, cu_seqlens,
                                                               implementation)
    y, pool = run_paged(REGISTRY, arrays, options, state_pool, initial_state_indices=initial_state_indices,
                        has_initial_state=has_initial_state, final_state_indices=final_state_indices,
                        checkpoint_state_indices=checkpoint_state_indices, cu_seqlens=cu_seqlens,
                        checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, donate=donate,
                        **run_options)
    return unflatten(y, batch), pool
