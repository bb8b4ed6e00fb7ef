"""The static contract of every public op entry, checked once before anything is chosen, launched or written.

Only what is known at trace time is checked here (shapes, dtypes, Python scalars), so the checks hold under
`jax.jit` with traced metadata too; concrete metadata values are checked on the host by `jaxckpt.plan.conventions`
(`host_metadata`, `validate_pool_slots`). Each failure is a `ValueError` that starts with the argument's name.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import jax.numpy as jnp

from jaxckpt.ops.common.xla_arrays import check_float, packed_metadata
from jaxckpt.plan.conventions import check_flag, check_int

KERNEL_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def kernel_dtype_reason(arrays: Mapping[str, object]) -> str | None:
    """None when every named array is float32, bfloat16 or float16 (what the Pallas kernels load), else the reason a
    kernel backend declines the call with."""
    for name, x in arrays.items():
        if x.dtype not in KERNEL_FLOAT_DTYPES:
            return f"{name}: dtype must be float32, bfloat16 or float16 on this backend, got {x.dtype}"
    return None


def tuning_reason(tuning: Mapping[str, object], keys: tuple, *, chunk_size, chunk_sizes: tuple) -> str | None:
    """None when every tuning option is one of `keys` and `chunk_size` one of `chunk_sizes`, else the reason a kernel
    backend declines the call with."""
    unknown = sorted(set(tuning) - set(keys))
    if unknown:
        return f"tuning: unknown options {unknown}, expected some of {keys}"
    if chunk_size not in chunk_sizes:
        return f"chunk_size: must be one of {chunk_sizes}, got {chunk_size!r}"
    return None


def _shape(array) -> tuple[int, ...]:
    return tuple(jnp.shape(array))


def _dtype(array):
    return jnp.asarray(array).dtype if not hasattr(array, "dtype") else jnp.dtype(array.dtype)


def check_index_vector(array, length: int, *, name: str, spec: str):
    """An integer (not boolean) index array of `length` entries."""
    if array is None:
        raise ValueError(f"{name}: required, expected {spec}")
    dtype = _dtype(array)
    if dtype == jnp.bool_ or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{name}: dtype must be an integer type, got {dtype}")
    if _shape(array) != (length,):
        raise ValueError(f"{name}: expected {spec} = ({length},), got shape {_shape(array)}")


def check_flag_vector(array, length: int, *, name: str):
    if array is None:
        raise ValueError(f"{name}: required, expected bool[N] = ({length},)")
    if _dtype(array) != jnp.bool_:
        raise ValueError(f"{name}: dtype must be bool, got {_dtype(array)}")
    if _shape(array) != (length,):
        raise ValueError(f"{name}: expected bool[N] = ({length},), got shape {_shape(array)}")


def check_call(num_tokens: int, options: Mapping[str, object], *, initial_state, cu_seqlens, checkpoint_cu,
               checkpoint_offsets, num_decodes, state_shape: tuple[int, ...]) -> tuple[int, int]:
    """The static contract of one packed call; returns (rows N, checkpoint entries M)."""
    cu, _, offsets = packed_metadata(cu_seqlens, checkpoint_cu, checkpoint_offsets, num_tokens)
    num_rows, num_checkpoints = cu.shape[0] - 1, offsets.shape[0]
    if check_int(num_decodes, name="num_decodes", minimum=0) > num_rows:
        raise ValueError(f"num_decodes: must be at most the row count {num_rows}, got {num_decodes}")
    if "scale" in options and options["scale"] is not None:
        scale = options["scale"]
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
            raise ValueError(f"scale: must be a finite Python number (a static option), got {scale!r}")
    if "use_qk_l2norm" in options:
        check_flag(options["use_qk_l2norm"], name="use_qk_l2norm")
    if initial_state is not None:
        check_float(initial_state, name="initial_state")
        expected = (num_rows, *state_shape)
        if _shape(initial_state) != expected:
            raise ValueError(f"initial_state: expected [N, ...] = {expected} (one state per row), got shape "
                             f"{_shape(initial_state)}")
    return num_rows, num_checkpoints


def check_paged(state_pool, *, num_rows: int, num_checkpoints: int, state_shape: tuple[int, ...],
                initial_state_indices, has_initial_state, final_state_indices, checkpoint_state_indices, donate):
    """The static contract of the paged form: the pool, one slot and flag per row, one slot per checkpoint entry."""
    check_float(state_pool, name="state_pool")
    shape = _shape(state_pool)
    if len(shape) != len(state_shape) + 1 or shape[1:] != tuple(state_shape) or shape[0] < 1:
        raise ValueError(f"state_pool: expected [S, ...] = (S, {', '.join(map(str, state_shape))}) with S >= 1, "
                         f"got shape {shape}")
    check_index_vector(initial_state_indices, num_rows, name="initial_state_indices", spec="i32[N]")
    check_flag_vector(has_initial_state, num_rows, name="has_initial_state")
    check_index_vector(final_state_indices, num_rows, name="final_state_indices", spec="i32[N]")
    if checkpoint_state_indices is not None:  # None: the checkpoint states are computed and not stored
        check_index_vector(checkpoint_state_indices, num_checkpoints, name="checkpoint_state_indices",
                           spec="i32[M]")
    check_flag(donate, name="donate")
