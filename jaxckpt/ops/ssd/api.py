"""Public entry of Mamba2's SSD scan: `implementation=` switch, batched or packed inputs, decode rows, paged pools."""

from __future__ import annotations

from types import MappingProxyType

from jaxckpt.ops.common.api import flatten_batch, run, run_paged, unflatten
from jaxckpt.ops.common.configs import SSD_CONFIGS
from jaxckpt.ops.common.recurrent_step import ssd_step

REGISTRY = MappingProxyType({
    "reference": "jaxckpt.ops.ssd.reference:ssd",
    "xla": "jaxckpt.ops.ssd.xla:ssd",
    "pallas_triton": "jaxckpt.ops.ssd.pallas_triton:ssd",
    "pallas_mosaic_gpu": "jaxckpt.ops.ssd.pallas_mosaic_gpu:ssd",
})


def _dt_limit(dt_limit):
    """(lo, hi) as Python floats: the kernels are compiled for the clamp (a static argument)."""
    if dt_limit is None:
        return None
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise ValueError(f"dt_limit: expected None or two numbers (lo, hi), got {dt_limit!r}") from None
    if not lo <= hi:
        raise ValueError(f"dt_limit: lo must not exceed hi, got {(lo, hi)}")
    return lo, hi


def _prepare(x, dt, A, B, C, D, dt_bias, z, dt_limit, cu_seqlens, state_layout, chunk_size, implementation,
             checkpoint_method, num_decodes, config):
    (x, dt, B, C, z), cu_seqlens, batch = flatten_batch([x, dt, B, C, z], cu_seqlens, packed_ndim=3, name="x")
    dt_limit = _dt_limit(dt_limit)
    arrays = dict(x=x, dt=dt, B=B, C=C) | ({} if z is None else dict(z=z))
    options = dict(A=A, D=D, dt_bias=dt_bias, dt_limit=dt_limit, state_layout=state_layout)
    num_heads, head_p = x.shape[1:]
    state_n = B.shape[-1]
    shape = (num_heads, head_p, state_n) if state_layout == "vk" else (num_heads, state_n, head_p)
    run_options = dict(implementation=implementation, checkpoint_method=checkpoint_method, num_decodes=num_decodes,
                       decode_step=ssd_step, state_shape=shape, chunk_size=chunk_size, configs=SSD_CONFIGS,
                       config=config)
    return arrays, options, cu_seqlens, batch, run_options


def ssd(x, dt, A, B, C, *, D=None, dt_bias=None, z=None, dt_limit=None, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="vk", implementation=None,
        checkpoint_method="in_chunk", num_decodes=0, chunk_size=64, config=None):
    """Mamba2's SSD over packed varlen rows, exporting the state at every checkpoint in the same pass.

    x               # [T, H, P]; or [B, T, H, P] with cu_seqlens=None; or [1, T, H, P] with cu_seqlens (FLA's form)
    dt              # [T, H] raw: delta = softplus(dt + dt_bias), clamped to dt_limit=(lo, hi) when given
    A               # [H] negative
    B, C            # [T, G, N]; head h reads group h // (H // G)
    D               # [H] or [H, P] skip; z [T, H, P] optional gate (y * silu(z))
    initial_state   # [N, H, P, N] ("vk", mamba_ssm's) or [N, H, N, P] ("kv"); None = zeros
    Checkpoints, implementations, methods and decode rows as `jaxckpt.ops.gated_delta_rule`; `config`:
    `jaxckpt.ops.XlaConfig`, `SsdPallasTritonConfig` or `SsdPallasMosaicGpuConfig`.
    Returns (y [T, H, P], final_state fp32, checkpoint_states fp32 [M, ...]).
    """
    arrays, options, cu_seqlens, batch, run_options = _prepare(
        x, dt, A, B, C, D, dt_bias, z, dt_limit, cu_seqlens, state_layout, chunk_size, implementation,
        checkpoint_method, num_decodes, config)
    y, final, ckpt = run(REGISTRY, arrays, options, initial_state=initial_state, cu_seqlens=cu_seqlens,
                         checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, **run_options)
    return unflatten(y, batch), final, ckpt


def ssd_paged(x, dt, A, B, C, state_pool, *, initial_state_indices, has_initial_state, final_state_indices,
              checkpoint_state_indices=None, D=None, dt_bias=None, z=None, dt_limit=None, cu_seqlens=None,
              checkpoint_cu=None, checkpoint_offsets=None, state_layout="vk", implementation=None,
              checkpoint_method="in_chunk", num_decodes=0, chunk_size=64, config=None, donate=True):
    """`ssd` over a paged state pool [S, H, P, N] (fp32 or bf16): returns (y, state_pool)."""
    arrays, options, cu_seqlens, batch, run_options = _prepare(
        x, dt, A, B, C, D, dt_bias, z, dt_limit, cu_seqlens, state_layout, chunk_size, implementation,
        checkpoint_method, num_decodes, config)
    y, pool = run_paged(REGISTRY, arrays, options, state_pool, initial_state_indices=initial_state_indices,
                        has_initial_state=has_initial_state, final_state_indices=final_state_indices,
                        checkpoint_state_indices=checkpoint_state_indices, cu_seqlens=cu_seqlens,
                        checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, donate=donate,
                        **run_options)
    return unflatten(y, batch), pool
