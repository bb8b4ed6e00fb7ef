"""Public entry of the grouped matmul: validation, group-size normalisation and the choice of implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxckpt.ops.grouped_matmul import pallas_triton, xla
from jaxckpt.ops.grouped_matmul.pallas_triton import GroupedMatmulConfig

IMPLEMENTATIONS = ("pallas_triton", "xla")
_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))


def _check(lhs, rhs, group_sizes, preferred_element_type, precision, config, implementation):
    if getattr(lhs, "ndim", None) != 2:
        raise ValueError(f"lhs: must be [M, K], got shape {getattr(lhs, 'shape', None)}")
    if getattr(rhs, "ndim", None) != 3:
        raise ValueError(f"rhs: must be [G, K, N], got shape {getattr(rhs, 'shape', None)}")
    if rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"rhs: K = rhs.shape[1] must equal lhs.shape[1], got rhs {rhs.shape} for lhs {lhs.shape}")
    if jnp.dtype(lhs.dtype) not in _FLOATS:
        raise ValueError(f"lhs: dtype must be a float (bfloat16, float16, float32, float64), got {lhs.dtype}")
    if jnp.dtype(rhs.dtype) != jnp.dtype(lhs.dtype):
        raise ValueError(f"rhs: dtype must equal lhs's ({lhs.dtype}), got {rhs.dtype}")
    if getattr(group_sizes, "shape", None) != (rhs.shape[0],):
        raise ValueError(f"group_sizes: must be [G] = [{rhs.shape[0]}] (rhs.shape[0]), "
                         f"got shape {getattr(group_sizes, 'shape', None)}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes: dtype must be an integer, got {group_sizes.dtype}")
    if preferred_element_type is not None and jnp.dtype(preferred_element_type) not in _FLOATS:
        raise ValueError(f"preferred_element_type: must be None or a float dtype, got {preferred_element_type!r}")
    if precision is not None and not isinstance(precision, jax.lax.Precision):
        raise ValueError(f"precision: must be None or a jax.lax.Precision, got {precision!r}")
    if config is not None and not isinstance(config, GroupedMatmulConfig):
        raise ValueError(f"config: must be None or a GroupedMatmulConfig, got {type(config).__name__}")
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation: must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")


def _on_nvidia_gpu() -> bool:
    return jax.default_backend() == "gpu" and "nvidia" in jax.devices()[0].device_kind.lower()


def _choose(lhs, rhs, implementation) -> str:
    if implementation is not None:
        reason = pallas_triton.supports(lhs, rhs) if implementation == "pallas_triton" else None
        if reason:
            raise ValueError(f"implementation: 'pallas_triton' cannot run this call ({reason}); use 'xla'")
        return implementation
    if _on_nvidia_gpu() and pallas_triton.supports(lhs, rhs) is None:
        return "pallas_triton"
    return "xla"


def _kernel_precision(precision, dtype):
    """The fp32 product precision of the kernel: an explicit `precision`, else jax's default_matmul_precision
    ("highest" / "float32" give IEEE fp32, anything else TF32), as XLA resolves precision=None."""
    if precision is not None or jnp.dtype(dtype) != jnp.float32:
        return precision
    default = jax.config.jax_default_matmul_precision
    return jax.lax.Precision.HIGHEST if default in ("highest", "float32") else jax.lax.Precision.DEFAULT


def _normalised_sizes(group_sizes, num_rows):
    """group_sizes clipped to >= 0 and cut where their sum passes num_rows (rows that do not exist), i32[G]."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), num_rows)
    return jnp.diff(ends, prepend=0).astype(jnp.int32)


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None, precision=None,
                   config: GroupedMatmulConfig | None = None, implementation: str | None = None):
    """Grouped matmul with `jax.lax.ragged_dot`'s semantics, without its dense GPU lowering.

    lhs                     # [M, K], rows sorted by group: group g owns the next group_sizes[g] rows
    rhs                     # [G, K, N], same dtype as lhs
    group_sizes             # int[G], may be traced; sum <= M (rows past the sum come back as zeros). Negative
                            # sizes count as 0 and a sum past M is cut at M.
    preferred_element_type  # output dtype (None: lhs's); the kernel accumulates in fp32 either way
    precision               # jax.lax.Precision of fp32 products (None: jax's default_matmul_precision); in the
                            # kernel HIGHEST is IEEE fp32 and anything else TF32; 16-bit products are exact
    config                  # GroupedMatmulConfig of the Pallas kernel (None: `default_config`); only for it
    implementation          # None: "pallas_triton" on an NVIDIA GPU for bfloat16, float16 and float32, else
                            # "xla" (ragged_dot)
    -> [M, N]. Differentiable in lhs and rhs with either implementation.
    """
    _check(lhs, rhs, group_sizes, preferred_element_type, precision, config, implementation)
    name = _choose(lhs, rhs, implementation)
    sizes = _normalised_sizes(group_sizes, lhs.shape[0])
    dtype = None if preferred_element_type is None else np.dtype(preferred_element_type)
    if name == "xla":
        if config is not None:
            raise ValueError("config: tiles of the Pallas kernel, but the call runs 'xla' (ragged_dot)")
        return xla.grouped_matmul(lhs, rhs, sizes, preferred_element_type=dtype, precision=precision)
    return pallas_triton.grouped_matmul(lhs, rhs, sizes, preferred_element_type=dtype,
                                        precision=_kernel_precision(precision, lhs.dtype), config=config)
