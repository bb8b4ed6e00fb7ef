"""Head-sharded recurrent ops: the public ops under `jax.shard_map`, every shard running whole heads.

The recurrences never mix heads, so splitting the head axis over one mesh axis needs no communication: each device
runs the public op (`implementation="xla"` unless one is named or a `config=` picks one) on its heads and the
outputs, final states and checkpoint states come back sharded on the same axis. GDN / KDA split q, k on the key-head
axis and v, g, beta, the states on the value-head axis, so every shard holds whole GVA groups (the HV / H value heads
that read one key head). SSD splits x, dt, A, D, dt_bias, z and the states on heads; B, C are split on groups when
the groups divide evenly over the shards, otherwise replicated, each shard slicing out the one group its heads read.
The conv splits channels.

The row metadata is global: `cu_seqlens`, `checkpoint_cu` and `checkpoint_offsets` are validated once on the host
and replicated (`P()`) to every shard. `checkpoint_method="split"` plans its launches on the host, so there the
metadata is closed over as constants instead. Batched `[B, T, ...]` inputs are packed into B rows first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxckpt.ops.common.api import flatten_batch, host_metadata, unflatten
from jaxckpt.ops.conv1d.api import causal_conv1d
from jaxckpt.ops.delta_rule.api import gated_delta_rule, kda
from jaxckpt.ops.ssd.api import ssd

_METADATA = ("cu_seqlens", "checkpoint_cu", "checkpoint_offsets")


def _axis_size(mesh, axis: str) -> int:
    if axis not in mesh.axis_names:
        raise ValueError(f"axis: {axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    return int(mesh.shape[axis])


def _check_divisible(name: str, what: str, count: int, shards: int, axis: str):
    if count % shards:
        raise ValueError(f"{name}: {what} {count} must be divisible by the size {shards} of mesh axis {axis!r}")


def _metadata(num_tokens: int, cu_seqlens, checkpoint_cu, checkpoint_offsets, checkpoint_method: str):
    """(replicated arrays, constants): validated on the host once; 'split' keeps them concrete for its host plan."""
    values = dict(zip(_METADATA, host_metadata(num_tokens, cu_seqlens, checkpoint_cu, checkpoint_offsets)))
    if checkpoint_method == "split":
        return {}, values
    arrays = {name: jnp.asarray(v, jnp.int32) for name, v in values.items() if v is not None}
    return arrays, {name: v for name, v in values.items() if v is None}


def _implementation(implementation, options):
    """"xla" unless named or picked by a config: the portable path is the one every shard can run."""
    return "xla" if implementation is None and options.get("config") is None else implementation


def _run(mesh, axis: str, body, sharded: dict, specs: dict, replicated: dict, constants: dict):
    """shard_map of body(**sharded arrays, **replicated metadata) -> (out, final_state, checkpoint_states), all three
    split on `axis` (dimension 1); None arrays stay out of the call. Unchecked (`check_vma=False`): the Pallas
    kernels declare no varying manual axes on their outputs, and the body has no collectives to check."""
    arrays = {name: a for name, a in sharded.items() if a is not None}
    in_specs = {name: specs[name] for name in arrays} | {name: P() for name in replicated}
    out_spec = P(None, axis)
    offsets = replicated.get("checkpoint_offsets", constants.get("checkpoint_offsets"))
    if offsets is not None and jnp.shape(offsets)[0]:
        mapped = jax.shard_map(lambda kw: body(**kw), mesh=mesh, in_specs=(in_specs,), out_specs=(out_spec,) * 3,
                               check_vma=False)
        # one compiled program; eager shard_map would dispatch the op's many small primitives one by one per shard
        return jax.jit(mapped)(arrays | replicated)
    # XLA:CPU (jaxlib 0.11.2) crashes compiling a program with an empty checkpoint output split over 2+ devices, so
    # without checkpoints the [0, ...] result is built outside the map
    local = {}

    def without_checkpoints(kw):
        out, final, local["checkpoint_states"] = body(**kw)
        return out, final

    mapped = jax.shard_map(without_checkpoints, mesh=mesh, in_specs=(in_specs,), out_specs=(out_spec,) * 2,
                           check_vma=False)
    out, final = jax.jit(mapped)(arrays | replicated)
    empty = local["checkpoint_states"]
    shape = (0, empty.shape[1] * int(mesh.shape[axis]), *empty.shape[2:])
    return out, final, jnp.zeros(shape, empty.dtype)


def _delta_sharded(op, mesh, q, k, v, g, beta, *, axis, initial_state, cu_seqlens, checkpoint_cu,
                   checkpoint_offsets, checkpoint_method, implementation, per_head, options):
    (q, k, v, g, beta), cu_seqlens, batch = flatten_batch([q, k, v, g, beta], cu_seqlens, packed_ndim=3, name="q")
    shards = _axis_size(mesh, axis)
    _check_divisible("q", "key heads H =", q.shape[1], shards, axis)
    _check_divisible("v", "value heads HV =", v.shape[1], shards, axis)
    replicated, constants = _metadata(q.shape[0], cu_seqlens, checkpoint_cu, checkpoint_offsets, checkpoint_method)
    sharded = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, **per_head)
    specs = dict(q=P(None, axis), k=P(None, axis), v=P(None, axis), g=P(None, axis), beta=P(None, axis),
                 initial_state=P(None, axis))
    specs |= {name: P(axis) for name in per_head}

    def body(**arrays):
        return op(**arrays, **constants, checkpoint_method=checkpoint_method,
                  implementation=_implementation(implementation, options), **options)

    o, final, ckpt = _run(mesh, axis, body, sharded, specs, replicated, constants)
    return unflatten(o, batch), final, ckpt


def gated_delta_rule_sharded(mesh, q, k, v, g, beta, *, axis="heads", initial_state=None, cu_seqlens=None,
                             checkpoint_cu=None, checkpoint_offsets=None, checkpoint_method="in_chunk",
                             implementation=None, **options):
    """`jaxckpt.ops.gated_delta_rule` with heads split over mesh axis `axis`; same arguments and results.

    q, k            # [T, H, K]: split on H (H divisible by the axis size)
    v               # [T, HV, V]; g, beta [T, HV]; initial_state [N, HV, ...]: split on HV, whole GVA groups each
    Returns (o [T, HV, V], final_state [N, HV, ...], checkpoint_states [M, HV, ...]), sharded on HV.
    """
    return _delta_sharded(gated_delta_rule, mesh, q, k, v, g, beta, axis=axis, initial_state=initial_state,
                          cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                          checkpoint_method=checkpoint_method, implementation=implementation, per_head={},
                          options=options)


def kda_sharded(mesh, q, k, v, g, beta, *, axis="heads", initial_state=None, cu_seqlens=None, checkpoint_cu=None,
                checkpoint_offsets=None, A_log=None, dt_bias=None, checkpoint_method="in_chunk",
                implementation=None, **options):
    """`jaxckpt.ops.kda` with heads split over mesh axis `axis`, as `gated_delta_rule_sharded`.

    g               # [T, HV, K] split on HV; A_log [HV] and dt_bias ([HV, K] or [HV * K], head-major) split likewise
    """
    per_head = {name: a for name, a in dict(A_log=A_log, dt_bias=dt_bias).items() if a is not None}
    return _delta_sharded(kda, mesh, q, k, v, g, beta, axis=axis, initial_state=initial_state, cu_seqlens=cu_seqlens,
                          checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                          checkpoint_method=checkpoint_method, implementation=implementation, per_head=per_head,
                          options=options)


def ssd_sharded(mesh, x, dt, A, B, C, *, axis="heads", D=None, dt_bias=None, z=None, initial_state=None,
                cu_seqlens=None, checkpoint_cu=None, checkpoint_offsets=None, checkpoint_method="in_chunk",
                implementation=None, **options):
    """`jaxckpt.ops.ssd` with heads split over mesh axis `axis`; same arguments and results.

    x               # [T, H, P]; dt [T, H]; A, dt_bias [H]; D [H] or [H, P]; z [T, H, P]: split on H
    B, C            # [T, G, N]: split on G when the axis size divides G; replicated when G divides the axis size
    Returns (y [T, H, P], final_state [N, H, ...], checkpoint_states [M, H, ...]), sharded on H.
    """
    (x, dt, B, C, z), cu_seqlens, batch = flatten_batch([x, dt, B, C, z], cu_seqlens, packed_ndim=3, name="x")
    shards = _axis_size(mesh, axis)
    num_heads, num_groups = x.shape[1], B.shape[1]
    _check_divisible("x", "heads H =", num_heads, shards, axis)
    if num_groups % shards and shards % num_groups:
        raise ValueError(f"B: groups G = {num_groups} must divide or be divisible by the size {shards} of mesh axis "
                         f"{axis!r}, so that each shard's heads read whole groups")
    split_groups = num_groups % shards == 0
    replicated, constants = _metadata(x.shape[0], cu_seqlens, checkpoint_cu, checkpoint_offsets, checkpoint_method)
    sharded = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, z=z, initial_state=initial_state)
    group_spec = P(None, axis) if split_groups else P()
    specs = dict(x=P(None, axis), dt=P(None, axis), A=P(axis), B=group_spec, C=group_spec, D=P(axis),
                 dt_bias=P(axis), z=P(None, axis), initial_state=P(None, axis))
    heads_per_group = num_heads // num_groups

    def body(x, dt, A, B, C, **rest):
        if not split_groups:
            # fewer groups than shards: this shard's H / shards heads all read the one group holding its first head
            group = jax.lax.axis_index(axis) * (num_heads // shards) // heads_per_group
            B = jax.lax.dynamic_slice_in_dim(B, group, 1, axis=1)
            C = jax.lax.dynamic_slice_in_dim(C, group, 1, axis=1)
        return ssd(x, dt, A, B, C, **rest, **constants, checkpoint_method=checkpoint_method,
                   implementation=_implementation(implementation, options), **options)

    y, final, ckpt = _run(mesh, axis, body, sharded, specs, replicated, constants)
    return unflatten(y, batch), final, ckpt


def causal_conv1d_sharded(mesh, x, weight, bias=None, *, axis="heads", initial_state=None, cu_seqlens=None,
                          checkpoint_cu=None, checkpoint_offsets=None, implementation=None, **options):
    """`jaxckpt.ops.causal_conv1d` with channels split over mesh axis `axis`; same arguments and results.

    x               # [T, D]; weight [D, W]; bias [D]; initial_state [N, D, W - 1]: split on D
    Returns (y [T, D], final_state [N, D, W - 1], checkpoint_states [M, D, W - 1]), sharded on D.
    """
    (x,), cu_seqlens, batch = flatten_batch([x], cu_seqlens, packed_ndim=2, name="x")
    _check_divisible("x", "channels D =", x.shape[1], _axis_size(mesh, axis), axis)
    replicated, constants = _metadata(x.shape[0], cu_seqlens, checkpoint_cu, checkpoint_offsets, "in_chunk")
    sharded = dict(x=x, weight=weight, bias=bias, initial_state=initial_state)
    specs = dict(x=P(None, axis), weight=P(axis), bias=P(axis), initial_state=P(None, axis))

    def body(x, weight, **rest):
        return causal_conv1d(x, weight, **rest, **constants, implementation=_implementation(implementation, options),
                             **options)

    y, final, ckpt = _run(mesh, axis, body, sharded, specs, replicated, constants)
    return unflatten(y, batch), final, ckpt


__all__ = ["causal_conv1d_sharded", "gated_delta_rule_sharded", "kda_sharded", "ssd_sharded"]
