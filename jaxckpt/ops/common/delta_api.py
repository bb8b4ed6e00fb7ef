"""Argument handling shared by the GDN and KDA public entries."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from jaxckpt.ops.common.api import flatten_batch
from jaxckpt.ops.common.configs import DELTA_CONFIGS


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
