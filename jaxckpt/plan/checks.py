"""The ops' input conventions as static checks, shared by every implementation (references, XLA, Pallas, torch_bridge's
Triton kernels): shapes and scalar options only, so numpy, jax (also while tracing) and torch arrays pass through the
same rules and messages. Dtype rules stay with each implementation, except that index metadata is integer and the
float64 references take any float input (`to_float64`)."""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np

from jaxckpt.plan.conventions import check_flag

REFERENCE_DTYPES = ("float16", "bfloat16", "float32", "float64")


def to_float64(x, *, name: str) -> np.ndarray:
    """A float64 copy of `x`, whose dtype must be one of REFERENCE_DTYPES (bfloat16 as in ml_dtypes / jax): the float64
    references' input rule."""
    array = np.asarray(x)
    if array.dtype.name not in REFERENCE_DTYPES:
        raise ValueError(f"{name}: dtype must be float16, bfloat16, float32 or float64, got {array.dtype}")
    return array.astype(np.float64)


def check_shape(array, expected: tuple, *, name: str, spec: str) -> None:
    if tuple(array.shape) != tuple(expected):
        raise ValueError(f"{name}: expected {spec} = {tuple(expected)}, got shape {tuple(array.shape)}")


def _check_index_array(array, *, name: str, spec: str) -> None:
    if array.ndim != 1:
        raise ValueError(f"{name}: expected {spec}, got shape {tuple(array.shape)}")
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name}: must hold integers, got dtype {array.dtype}")


def check_metadata_shapes(cu_seqlens, checkpoint_cu, checkpoint_offsets) -> None:
    """cu_seqlens i32[N + 1] with N >= 1, checkpoint_cu i32[N + 1], checkpoint_offsets i32[M]: integer 1-D arrays."""
    _check_index_array(cu_seqlens, name="cu_seqlens", spec="i32[N + 1]")
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: needs at least 2 entries (N + 1 for N >= 1 rows), got {cu_seqlens.shape[0]}")
    _check_index_array(checkpoint_cu, name="checkpoint_cu", spec="i32[N + 1]")
    if checkpoint_cu.shape[0] != cu_seqlens.shape[0]:
        raise ValueError(f"checkpoint_cu: needs N + 1 = {cu_seqlens.shape[0]} entries like cu_seqlens, "
                         f"got {checkpoint_cu.shape[0]}")
    _check_index_array(checkpoint_offsets, name="checkpoint_offsets", spec="i32[M]")


def check_dt_limit(dt_limit) -> tuple[float, float] | None:
    """None, or a pair (lo, hi) of Python numbers with lo <= hi (a static option)."""
    if dt_limit is None:
        return None
    try:
        pair = tuple(dt_limit)
    except TypeError:
        pair = ()
    if len(pair) != 2 or not all(isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) for v in pair):
        raise ValueError(f"dt_limit: expected None or a pair (lo, hi) of numbers, got {dt_limit!r}")
    lo, hi = (float(v) for v in pair)
    if not lo <= hi:
        raise ValueError(f"dt_limit: needs lo <= hi, got ({lo}, {hi})")
    return lo, hi


LOWER_BOUND_RANGE = (-5.0, 0.0)  # KDA's bounded gate (FLA's "safe gate"): lower_bound in [-5, 0)


def check_kda_gate(g, *, A_log=None, dt_bias=None, lower_bound=None) -> None:
    """The KDA gate's rules (`jaxckpt.ops.delta_rule.reference.kda_gate`): g [T, HV, K]; A_log [HV]; dt_bias [HV, K]
    or flat [HV * K], only with A_log or lower_bound; lower_bound a number in `LOWER_BOUND_RANGE`."""
    if g.ndim != 3:
        raise ValueError(f"g: expected [T, HV, K], got shape {tuple(g.shape)}")
    _, num_v_heads, head_k = g.shape
    if lower_bound is not None:
        low, high = LOWER_BOUND_RANGE
        if isinstance(lower_bound, (bool, np.bool_)) or not isinstance(lower_bound, numbers.Real) \
                or not low <= lower_bound < high:
            raise ValueError(f"lower_bound: must be a number in [{low:g}, {high:g}), got {lower_bound!r}")
    if dt_bias is not None:
        if A_log is None and lower_bound is None:
            raise ValueError("dt_bias: only used with A_log or lower_bound; without them g is the log decay itself")
        if tuple(dt_bias.shape) not in ((num_v_heads, head_k), (num_v_heads * head_k,)):
            raise ValueError(f"dt_bias: expected [HV, K] = {(num_v_heads, head_k)} or [HV * K] = "
                             f"({num_v_heads * head_k},), got shape {tuple(dt_bias.shape)}")
    if A_log is not None and tuple(A_log.shape) != (num_v_heads,):
        raise ValueError(f"A_log: expected [HV] = ({num_v_heads},), got shape {tuple(A_log.shape)}")


class DeltaDims(NamedTuple):
    num_tokens: int
    num_heads: int
    head_k: int
    num_v_heads: int
    head_v: int


def delta_dims(q, k, v, g, beta, *, per_channel_decay: bool) -> DeltaDims:
    """Checks the delta-rule inputs against each other: q, k [T, H, K]; v [T, HV, V]; g [T, HV] or [T, HV, K];
    beta [T, HV]; HV a positive multiple of H."""
    per_channel_decay = check_flag(per_channel_decay, name="per_channel_decay")
    if q.ndim != 3:
        raise ValueError(f"q: expected [T, H, K], got shape {tuple(q.shape)}")
    num_tokens, num_heads, head_k = q.shape
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k: expected [T, H, K] = {tuple(q.shape)} like q, got shape {tuple(k.shape)}")
    if v.ndim != 3 or v.shape[0] != num_tokens:
        raise ValueError(f"v: expected [T, HV, V] with T={num_tokens} like q, got shape {tuple(v.shape)}")
    num_v_heads, head_v = v.shape[1:]
    if num_heads == 0 or num_v_heads == 0 or num_v_heads % num_heads:
        raise ValueError(f"v: value heads HV={num_v_heads} must be a positive multiple of the key heads "
                         f"H={num_heads} of q and k")
    if per_channel_decay:
        check_shape(g, (num_tokens, num_v_heads, head_k), name="g", spec="[T, HV, K]")
    else:
        check_shape(g, (num_tokens, num_v_heads), name="g", spec="[T, HV]")
    check_shape(beta, (num_tokens, num_v_heads), name="beta", spec="[T, HV]")
    return DeltaDims(num_tokens, num_heads, head_k, num_v_heads, head_v)


class SsdDims(NamedTuple):
    num_tokens: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_dim: int


def ssd_dims(x, dt, A, B, C, *, D=None, dt_bias=None, z=None) -> SsdDims:
    """Checks the SSD inputs against each other: x [T, H, P]; dt [T, H]; A [H]; B, C [T, G, N] with G dividing H;
    D [H] or [H, P]; dt_bias [H]; z [T, H, P]."""
    if x.ndim != 3:
        raise ValueError(f"x: expected [T, H, P], got shape {tuple(x.shape)}")
    num_tokens, num_heads, head_dim = x.shape
    check_shape(dt, (num_tokens, num_heads), name="dt", spec="[T, H]")
    check_shape(A, (num_heads,), name="A", spec="[H]")
    if B.ndim != 3 or B.shape[0] != num_tokens:
        raise ValueError(f"B: expected [T, G, N] with T={num_tokens}, got shape {tuple(B.shape)}")
    num_groups, state_dim = B.shape[1:]
    if num_groups == 0 or num_heads % num_groups:
        raise ValueError(f"B: groups G={num_groups} must divide the heads H={num_heads}")
    check_shape(C, B.shape, name="C", spec="[T, G, N] like B")
    if D is not None and tuple(D.shape) not in ((num_heads,), (num_heads, head_dim)):
        raise ValueError(f"D: expected [H] = ({num_heads},) or [H, P] = {(num_heads, head_dim)}, "
                         f"got shape {tuple(D.shape)}")
    if dt_bias is not None:
        check_shape(dt_bias, (num_heads,), name="dt_bias", spec="[H]")
    if z is not None:
        check_shape(z, x.shape, name="z", spec="[T, H, P] like x")
    return SsdDims(num_tokens, num_heads, head_dim, num_groups, state_dim)


def check_ssd_state(initial_state, dims: SsdDims, num_rows: int, state_layout: str) -> None:
    if state_layout == "vk":
        check_shape(initial_state, (num_rows, dims.num_heads, dims.head_dim, dims.state_dim), name="initial_state",
                    spec='[N_rows, H, P, N] ("vk")')
    else:
        check_shape(initial_state, (num_rows, dims.num_heads, dims.state_dim, dims.head_dim), name="initial_state",
                    spec='[N_rows, H, N, P] ("kv")')


CONV_WIDTHS = (2, 3, 4)
CONV_ACTIVATIONS = (None, "silu", "swish")


def conv_dims(x, weight, bias=None, *, activation) -> tuple[int, int, int]:
    """Checks the conv inputs: x [T, D]; weight [D, W] with W in CONV_WIDTHS; bias [D]. Returns (T, D, W)."""
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"activation: must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    if x.ndim != 2:
        raise ValueError(f"x: expected [T, D], got shape {tuple(x.shape)}")
    num_tokens, dim = x.shape
    if weight.ndim != 2 or weight.shape[0] != dim:
        raise ValueError(f"weight: expected [D, W] with D={dim}, got shape {tuple(weight.shape)}")
    width = weight.shape[1]
    if width not in CONV_WIDTHS:
        raise ValueError(f"weight: width W must be one of {CONV_WIDTHS}, got {width}")
    if bias is not None:
        check_shape(bias, (dim,), name="bias", spec="[D]")
    return num_tokens, dim, width
