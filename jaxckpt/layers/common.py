"""Building blocks the layers share: torch-layout linear and short-conv weights, initializers, and parameter I/O.

Weights keep the layout of the public torch checkpoints (`weight` [out, in] for linears, [D, W] for depthwise convs),
so a layer's parameter names, joined with dots, are the checkpoint's names and loading needs no transposes.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_HIGHEST = jax.lax.Precision.HIGHEST


class Linear(nnx.Module):
    """y = x @ weight.T (+ bias), weight [out, in] as in torch; init N(0, 1 / in) keeps activations O(1)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        std = in_features ** -0.5
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (out_features, in_features)) * std).astype(dtype))
        self.bias = nnx.Param(jnp.zeros(out_features, dtype)) if bias else None

    def __call__(self, x):  # [..., in] -> [..., out]
        y = jnp.einsum("...i,oi->...o", x, self.weight[...], precision=_HIGHEST)
        return y if self.bias is None else y + self.bias[...]


class ShortConv(nnx.Module):
    """Weights of a depthwise causal conv: weight [D, W] (torch's [D, 1, W] squeezed), optional bias [D]."""

    def __init__(self, channels: int, width: int, *, bias: bool, dtype=jnp.float32, rngs: nnx.Rngs):
        bound = width ** -0.5
        self.weight = nnx.Param(jax.random.uniform(rngs.params(), (channels, width), minval=-bound,
                                                   maxval=bound).astype(dtype))
        self.bias = nnx.Param(jnp.zeros(channels, dtype)) if bias else None


def a_log_init(key, shape, *, low: float = 1.0, high: float = 16.0):
    """A_log = log A, A ~ U(low, high) (mamba_ssm and FLA defaults): per-step decays exp(-A * dt) stay moderate."""
    return jnp.log(jax.random.uniform(key, shape, minval=low, maxval=high))


def dt_bias_init(key, shape, *, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4):
    """dt_bias = softplus^-1(dt) with dt log-uniform in [dt_min, dt_max], so softplus(0 + dt_bias) = dt at init."""
    u = jax.random.uniform(key, shape)
    dt = jnp.maximum(jnp.exp(u * (np.log(dt_max) - np.log(dt_min)) + np.log(dt_min)), floor)
    return dt + jnp.log(-jnp.expm1(-dt))


def param_dict(module: nnx.Module) -> dict[str, np.ndarray]:
    """Every nnx.Param of `module` as {dotted name: numpy array} (the checkpoint names of the layer or model)."""
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return {".".join(map(str, path)): np.asarray(variable[...]) for path, variable in flat}


def load_params(module: nnx.Module, params: Mapping[str, np.ndarray], *, strict: bool = True) -> None:
    """Sets the parameters of `module` in place from {dotted name: array}, cast to each parameter's dtype.

    An array may differ from the parameter's shape only by size-1 axes (torch conv weights [D, 1, W], vLLM's A_log
    [1, 1, H, 1]). With `strict`, names missing from `params` or unknown to the module raise ValueError. The module
    may be abstract (`nnx.eval_shape`): loading then allocates each parameter once, from the checkpoint.
    """
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    names = {".".join(map(str, path)): variable for path, variable in flat}
    if strict:
        missing = sorted(set(names) - set(params))
        unknown = sorted(set(params) - set(names))
        if missing or unknown:
            raise ValueError(f"params: missing {missing}, unknown {unknown}")
    for name, variable in names.items():
        if name not in params:
            continue
        array = np.asarray(params[name])
        current = variable.get_value()  # an array, or a ShapeDtypeStruct in a model built by nnx.eval_shape
        target = current.shape
        squeezed = tuple(d for d in array.shape if d != 1)
        if array.shape != target and squeezed != tuple(d for d in target if d != 1):
            raise ValueError(f"params: {name} has shape {array.shape}, expected {target}")
        variable.set_value(jnp.asarray(array.reshape(target), current.dtype))


def state_pools(shapes, num_slots: int, *, fill: float = 0.0, dtype=jnp.float32):
    """Pools [num_slots, *shape] for a layer's `state_shapes` (conv, recurrent); `fill=nan` poisons them for tests."""
    if num_slots < 2:
        raise ValueError(f"num_slots: a state pool needs at least 2 slots (slot 0 is the null slot), got {num_slots}")
    return tuple(jnp.full((num_slots, *shape), fill, dtype) for shape in shapes)


def _conv_implementation(implementation):
    from jaxckpt.ops.conv1d.api import REGISTRY
    return implementation if implementation in REGISTRY else None


class PagedRunner:
    """The conv and scan calls of one layer step over its (conv_pool, state_pool); `pools` holds the new pools.

    `scan_op` is a `jaxckpt.ops.*_paged` entry; both ops read the step's slots and write final and checkpoint states
    (conv window and recurrent state of a checkpoint land in the same slot of the two pools).
    """

    def __init__(self, meta, pools, scan_op, *, implementation, chunk_size: int):
        self.meta = meta
        self.pools = tuple(pools)
        self.scan_op = scan_op
        self.implementation = implementation
        self.chunk_size = chunk_size

    def conv(self, x, weight, bias=None):  # [T, D] -> [T, D], SiLU
        from jaxckpt.ops import causal_conv1d_paged

        y, conv_pool = causal_conv1d_paged(x, weight, self.pools[0], bias, **self.meta.paged_kwargs(),
                                           implementation=_conv_implementation(self.implementation), donate=False)
        self.pools = (conv_pool, self.pools[1])
        return y

    def scan(self, *arrays, **options):
        out, state_pool = self.scan_op(*arrays, self.pools[1], **options, **self.meta.paged_kwargs(),
                                       num_decodes=self.meta.num_decodes, implementation=self.implementation,
                                       chunk_size=self.chunk_size, donate=False)
        self.pools = (self.pools[0], state_pool)
        return out


class PlainRunner:
    """The conv and scan calls over one whole sequence from a zero state, no pools: the layers' parity oracle."""

    def __init__(self, scan_op, *, implementation, chunk_size: int):
        self.scan_op = scan_op
        self.implementation = implementation
        self.chunk_size = chunk_size

    def conv(self, x, weight, bias=None):
        from jaxckpt.ops import causal_conv1d

        y, _, _ = causal_conv1d(x, weight, bias, implementation=_conv_implementation(self.implementation))
        return jnp.asarray(y, x.dtype)

    def scan(self, *arrays, **options):
        out, _, _ = self.scan_op(*arrays, **options, implementation=self.implementation, chunk_size=self.chunk_size)
        return jnp.asarray(out, arrays[0].dtype)
