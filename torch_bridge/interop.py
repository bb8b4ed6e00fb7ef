"""The DLPack bridge between torch and JAX, and the torch side of vLLM-style state pools.

Flow of a paged call: torch validates every slot on the host, gathers the rows' initial states from the pools
(`gather_states`), JAX computes dense outputs, final and checkpoint states (`jaxckpt.ops.*` with the implementation
asked for), and torch writes the states back into the pools in place (`write_states`, `index_copy_`). JAX treats a
buffer imported through DLPack as immutable and cannot alias a pool that vLLM updates in place, which is why the pools
themselves never cross the bridge: only the gathered copies and JAX's fresh outputs do.

Streams: `to_jax` synchronizes torch's current stream of the tensor's device before the export (JAX runs on its own
streams and would otherwise read buffers torch has not finished writing); `to_torch` blocks until the JAX array is
ready before torch reads it (DLPack export from JAX waits too, the explicit call makes the order visible). A shared
GPU needs `XLA_PYTHON_CLIENT_PREALLOCATE=false` (or a memory fraction) before JAX starts: `share_gpu_with_jax()`.

Index metadata (`cu_seqlens`, checkpoint CSR lists, slots) travels as host numpy int32, never through DLPack: JAX
without x64 would truncate FLA's int64 `cu_seqlens`, and host values let jaxckpt validate and plan on the host.
jax is imported lazily, so `import torch_bridge.interop` works where jax is absent; the pool helpers need only torch.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import NamedTuple

import numpy as np
import torch

from jaxckpt.plan.conventions import (NULL_SLOT, check_int_array, map_vllm_slots, validate_checkpoints,
                                      validate_cu_seqlens, validate_slots)

_METADATA = ("cu_seqlens", "checkpoint_cu", "checkpoint_offsets")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def share_gpu_with_jax() -> bool:
    """Sets `XLA_PYTHON_CLIENT_PREALLOCATE=false` so JAX does not claim 75% of a GPU torch also uses.

    Call it before JAX's first computation. Returns False (and warns) when JAX's backends already started, since the
    setting is read only then; an explicit value already in the environment is kept.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            warnings.warn("share_gpu_with_jax: JAX's backends already started; XLA_PYTHON_CLIENT_PREALLOCATE "
                          "takes effect only in a new process", stacklevel=2)
            return False
    return True


def to_jax(tensor, *, name: str = "tensor"):
    """A JAX array viewing `tensor` through DLPack (zero-copy on GPU; bfloat16 included). Treat it as read-only.

    `tensor` must be contiguous (a strided view would need a copy JAX might make silently). torch's current stream
    is synchronized first, so JAX reads finished data.
    """
    import jax.numpy as jnp

    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: must be contiguous for a DLPack export (strides {tuple(tensor.stride())}); "
                         "call .contiguous() first")
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
    return jnp.from_dlpack(tensor)


def to_torch(array) -> torch.Tensor:
    """A torch tensor viewing a JAX array through DLPack, after the array is ready. Do not write into it."""
    array.block_until_ready()
    return torch.from_dlpack(array)


def host_ints(value, *, name: str) -> np.ndarray:
    """An integer vector (torch tensor, numpy array or sequence) as host int64; one device read for a tensor."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name}: must be an integer tensor, got {value.dtype}")
        value = value.detach().cpu().numpy()
    return check_int_array(value, name=name)


def vllm_slots(value, num_slots: int, size: int, *, name: str, per: str) -> np.ndarray:
    """i32[size] slots into a pool of `num_slots` (one per `per`), vLLM's -1 padding mapped to the null slot."""
    raw = host_ints(value, name=name)
    if raw.size != size:
        raise ValueError(f"{name}: needs {size} slots (one per {per}), got {raw.size}")
    if raw.size and raw.min() < -1:
        raise ValueError(f"{name}: vLLM slots must be >= -1, got {int(raw.min())}")
    return validate_slots(map_vllm_slots(raw), num_slots, name=name)


def host_flags(value, num_rows: int, *, name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    flags = np.asarray(value)
    if flags.shape != (num_rows,) or flags.dtype != np.bool_:
        raise ValueError(f"{name}: expected bool[N] with N={num_rows}, got {flags.dtype} shape {flags.shape}")
    return flags


def host_metadata(num_tokens: int, cu_seqlens, checkpoint_cu, checkpoint_offsets):
    """Validated host metadata: (cu_seqlens i32[N + 1], checkpoint_cu i32[N + 1], checkpoint_offsets i32[M])."""
    cu = validate_cu_seqlens(None if cu_seqlens is None else host_ints(cu_seqlens, name="cu_seqlens"), num_tokens)
    ccu, offsets = validate_checkpoints(
        None if checkpoint_cu is None else host_ints(checkpoint_cu, name="checkpoint_cu"),
        None if checkpoint_offsets is None else host_ints(checkpoint_offsets, name="checkpoint_offsets"), cu)
    return cu, ccu, offsets


def check_tensor(t, device: torch.device, *, name: str, device_of: str, dtypes: tuple = _FLOAT_DTYPES,
                 shape: tuple | None = None, spec: str = "") -> torch.Tensor:
    """`t` if it is a torch tensor on `device` with a dtype in `dtypes` (and, given `shape`, that shape, which `spec`
    names), else a ValueError naming `name`; `device_of` names the argument `device` was taken from."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected {spec} = {tuple(shape)}, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected the device of {device_of} ({device})")
    if t.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        raise ValueError(f"{name}: dtype must be {', '.join(names[:-1])}{' or ' if len(names) > 1 else ''}"
                         f"{names[-1]}, got {t.dtype}")
    return t


def check_devices(tensors: dict, device: torch.device) -> None:
    """Every torch tensor in `tensors` must live on `device`."""
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor) and value.device != device:
            raise ValueError(f"{name}: on {value.device}, expected {device} like the other inputs")


class PoolSlots(NamedTuple):
    """Host slot tables of one paged call, validated: -1 and the null slot mean "no state" / "write nothing"."""

    initial: np.ndarray     # i64[N] slot to read, -1 = zeros (fresh row, null slot or has_initial_state False)
    final: np.ndarray       # i32[N] slot to write, NULL_SLOT = skip
    checkpoint: np.ndarray  # i32[M] slot to write, NULL_SLOT = skip (always for padded CSR entries)


def pool_slots(num_slots: int, num_rows: int, checkpoint_cu, num_checkpoints: int, *, initial_state_indices,
               has_initial_state, final_state_indices, checkpoint_state_indices=None) -> PoolSlots:
    """Validates the slot arguments of a paged call (vLLM -1 slots mapped to the null slot) before anything runs."""
    tables = {}
    for name, value, size, per in (("initial_state_indices", initial_state_indices, num_rows, "row"),
                                   ("final_state_indices", final_state_indices, num_rows, "row"),
                                   ("checkpoint_state_indices", checkpoint_state_indices, num_checkpoints,
                                    "checkpoint")):
        if value is None:
            if size and name != "checkpoint_state_indices":
                raise ValueError(f"{name}: required")
            tables[name] = np.full(size, NULL_SLOT, np.int32)
            continue
        tables[name] = vllm_slots(value, num_slots, size, name=name, per=per)
    flags = host_flags(has_initial_state, num_rows, name="has_initial_state")
    checkpoint = tables["checkpoint_state_indices"].copy()
    checkpoint[int(np.asarray(checkpoint_cu)[-1]):] = NULL_SLOT
    written = np.concatenate([tables["final_state_indices"], checkpoint])
    written = written[written != NULL_SLOT]
    if np.unique(written).size != written.size:
        raise ValueError("final_state_indices/checkpoint_state_indices: a slot is written twice in one call")
    initial = tables["initial_state_indices"].astype(np.int64)
    initial = np.where(flags & (initial != NULL_SLOT), initial, -1)
    return PoolSlots(initial, tables["final_state_indices"], checkpoint)


def check_pool(state_pool, state_shape: tuple, device: torch.device, *, name: str = "state_pool") -> None:
    check_tensor(state_pool, device, name=name, device_of="the inputs")
    if tuple(state_pool.shape[1:]) != tuple(state_shape):
        raise ValueError(f"{name}: expected [S, {', '.join(map(str, state_shape))}], got shape "
                         f"{tuple(state_pool.shape)}")


def gather_states(state_pool: torch.Tensor, initial: np.ndarray, *, dtype=torch.float32) -> torch.Tensor:
    """[N, ...] states read from the pool (rows with slot -1 get zeros; the null slot is never read)."""
    use = initial >= 0
    idx = torch.as_tensor(np.where(use, initial, 0), dtype=torch.long, device=state_pool.device)
    states = state_pool.index_select(0, idx).to(dtype)
    mask = torch.as_tensor(use, device=state_pool.device).reshape(-1, *([1] * (states.ndim - 1)))
    return torch.where(mask, states, torch.zeros((), dtype=dtype, device=state_pool.device))


def write_states(state_pool: torch.Tensor, slots: np.ndarray, states: torch.Tensor) -> None:
    """`state_pool[slots[i]] = states[i]` in the pool's dtype, in place; null-slot entries write nothing."""
    keep = np.nonzero(np.asarray(slots) != NULL_SLOT)[0]
    if not keep.size:
        return
    device = state_pool.device
    rows = torch.as_tensor(keep, dtype=torch.long, device=device)
    idx = torch.as_tensor(np.asarray(slots)[keep], dtype=torch.long, device=device)
    state_pool.index_copy_(0, idx, states.index_select(0, rows).to(state_pool.dtype))


def _jax_ops():
    return importlib.import_module("jaxckpt.ops")


def _dense(op_name: str, positional: dict, options: dict) -> tuple:
    """One jaxckpt op on torch tensors: tensors cross by DLPack, index metadata as host int32, outputs come back.

    jaxckpt validates the metadata on the host (concrete numpy values) before anything runs.
    """
    first = next(iter(positional.values()))
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"{next(iter(positional))}: expected a torch.Tensor, got {type(first).__name__}")
    check_devices({**positional, **options}, first.device)
    call = {}
    for name, value in options.items():
        if name in _METADATA and value is not None:
            call[name] = host_ints(value, name=name).astype(np.int32)
        elif isinstance(value, torch.Tensor):
            call[name] = to_jax(value, name=name)
        else:
            call[name] = value
    args = [None if a is None else to_jax(a, name=n) for n, a in positional.items()]
    outputs = getattr(_jax_ops(), op_name)(*args, **call)
    return tuple(to_torch(o) for o in outputs)


def _paged(op_name: str, positional: dict, options: dict, state_pool, state_shape: tuple, slot_args: dict):
    """Gather in torch, compute in JAX, write back in torch; returns the output, the pool is updated in place."""
    first = next(iter(positional.values()))
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"{next(iter(positional))}: expected a torch.Tensor, got {type(first).__name__}")
    check_devices({**positional, **options}, first.device)
    check_pool(state_pool, state_shape, first.device)
    cu, ccu, offsets = host_metadata(first.shape[0], options.get("cu_seqlens"), options.get("checkpoint_cu"),
                                     options.get("checkpoint_offsets"))
    slots = pool_slots(state_pool.shape[0], cu.size - 1, ccu, offsets.size, **slot_args)
    initial = gather_states(state_pool, slots.initial)
    out, final, checkpoint_states = _dense(op_name, positional, {**options, "initial_state": initial,
                                                                  "cu_seqlens": cu, "checkpoint_cu": ccu,
                                                                  "checkpoint_offsets": offsets})
    write_states(state_pool, slots.final, final)
    write_states(state_pool, slots.checkpoint, checkpoint_states)
    return out


def _slot_args(initial_state_indices, has_initial_state, final_state_indices, checkpoint_state_indices) -> dict:
    return dict(initial_state_indices=initial_state_indices, has_initial_state=has_initial_state,
                final_state_indices=final_state_indices, checkpoint_state_indices=checkpoint_state_indices)


def _delta_state_shape(v, k, state_layout: str) -> tuple:
    heads, dim_v = v.shape[-2:]
    dim_k = k.shape[-1]
    return (heads, dim_k, dim_v) if state_layout == "kv" else (heads, dim_v, dim_k)


def gated_delta_rule(q, k, v, g, beta, **options):
    """`jaxckpt.ops.gated_delta_rule` on torch tensors (same arguments; `implementation=` picks the JAX path).

    Returns torch tensors (o, final_state fp32, checkpoint_states fp32) on the inputs' device.
    """
    return _dense("gated_delta_rule", dict(q=q, k=k, v=v, g=g, beta=beta), options)


def kda(q, k, v, g, beta, **options):
    """`jaxckpt.ops.kda` on torch tensors; returns (o, final_state, checkpoint_states) as torch tensors."""
    return _dense("kda", dict(q=q, k=k, v=v, g=g, beta=beta), options)


def ssd(x, dt, A, B, C, **options):
    """`jaxckpt.ops.ssd` on torch tensors; returns (y, final_state, checkpoint_states) as torch tensors."""
    return _dense("ssd", dict(x=x, dt=dt, A=A, B=B, C=C), options)


def causal_conv1d(x, weight, bias=None, **options):
    """`jaxckpt.ops.causal_conv1d` on torch tensors; returns (y, final_state, checkpoint_states) as torch tensors."""
    return _dense("causal_conv1d", dict(x=x, weight=weight, bias=bias), options)


def gated_delta_rule_paged(q, k, v, g, beta, state_pool, *, initial_state_indices, has_initial_state,
                           final_state_indices, checkpoint_state_indices=None, **options):
    """`gated_delta_rule` over a torch state pool [S, HV, K, V] ("kv") or [S, HV, V, K] ("vk"), fp32/bf16/fp16.

    initial_state_indices, has_initial_state, final_state_indices  # i32[N], bool[N], i32[N]
    checkpoint_state_indices                                       # i32[M]
    Slots may use vLLM's -1 padding; -1 and the null slot 0 are never read as real states nor written, padded CSR
    entries write nothing. The pool is updated in place; returns o (torch).
    """
    shape = _delta_state_shape(v, k, options.get("state_layout", "kv"))
    return _paged("gated_delta_rule", dict(q=q, k=k, v=v, g=g, beta=beta), options, state_pool, shape,
                  _slot_args(initial_state_indices, has_initial_state, final_state_indices, checkpoint_state_indices))


def kda_paged(q, k, v, g, beta, state_pool, *, initial_state_indices, has_initial_state, final_state_indices,
              checkpoint_state_indices=None, **options):
    """`kda` over a torch state pool, as `gated_delta_rule_paged`; returns o, the pool is updated in place."""
    shape = _delta_state_shape(v, k, options.get("state_layout", "kv"))
    return _paged("kda", dict(q=q, k=k, v=v, g=g, beta=beta), options, state_pool, shape,
                  _slot_args(initial_state_indices, has_initial_state, final_state_indices, checkpoint_state_indices))


def ssd_paged(x, dt, A, B, C, state_pool, *, initial_state_indices, has_initial_state, final_state_indices,
              checkpoint_state_indices=None, **options):
    """`ssd` over a torch state pool [S, H, P, N] ("vk") or [S, H, N, P] ("kv"); returns y, pool updated in place."""
    heads, dim_p = x.shape[-2:]
    dim_n = B.shape[-1]
    shape = (heads, dim_p, dim_n) if options.get("state_layout", "vk") == "vk" else (heads, dim_n, dim_p)
    return _paged("ssd", dict(x=x, dt=dt, A=A, B=B, C=C), options, state_pool, shape,
                  _slot_args(initial_state_indices, has_initial_state, final_state_indices, checkpoint_state_indices))


def causal_conv1d_paged(x, weight, state_pool, bias=None, *, initial_state_indices, has_initial_state,
                        final_state_indices, checkpoint_state_indices=None, **options):
    """`causal_conv1d` over a torch conv-state pool [S, D, W - 1]; returns y, the pool is updated in place."""
    shape = (x.shape[-1], weight.shape[-1] - 1)
    return _paged("causal_conv1d", dict(x=x, weight=weight, bias=bias), options, state_pool, shape,
                  _slot_args(initial_state_indices, has_initial_state, final_state_indices, checkpoint_state_indices))
