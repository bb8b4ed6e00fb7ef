"""What every GDN / KDA kernel entry does around its pipeline: the gate's shape, the static checks, the backend's
decline reason raised as a ValueError, KDA's gate in plain jnp before the kernels; `kernel_entries` makes a kernel
pipeline's public pair (`gated_delta_rule`, `kda`) from these."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from jaxckpt.ops.delta_rule.chunk import check_static
from jaxckpt.ops.delta_rule.gate import kda_gate

_GDN_DOC = """Gated delta rule with a scalar log decay per token and value head, exporting checkpoint states.

    Arguments, shapes and results as `jaxckpt.ops.delta_rule.xla.gated_delta_rule` (packed rows; metadata may be
    traced and its values are trusted); {inputs}. `interpret=True` runs the kernels on CPU; `tuning`: the fields of
    `{config}`. Unsupported shapes or options raise ValueError with the reason `supports` gives. Padding tokens and
    padded checkpoint entries give zeros.
    """
_KDA_DOC = """Kimi Delta Attention: the gated delta rule with a log decay per token, value head and key channel.

    Arguments (the gate's A_log, dt_bias, lower_bound included), shapes and results as
    `jaxckpt.ops.delta_rule.xla.kda`; the gate runs in plain jnp (`gate.kda_gate`) before the kernels. Everything
    else as `gated_delta_rule`.
    """


def gate_reason(q, g) -> str | None:
    """None when g is a gate of the family, [T, HV] (GDN) or [T, HV, K] (KDA); its rank says which op the call is,
    and the entry's own static checks hold it to that op's shape."""
    if g.ndim == 2 or (g.ndim == 3 and g.shape[-1] == q.shape[-1]):
        return None
    return f"g: expected [T, HV] (GDN) or [T, HV, K] (KDA), got shape {g.shape}"


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


def kernel_entries(pipeline: Callable, supports: Callable, tuning_keys: tuple, *, inputs: str, config: str):
    """The jitted pair (gated_delta_rule, kda) of a kernel pipeline, each through `run_checked`; `tuning_keys` are
    the pipeline's static tuning fields, `inputs` (the dtypes and shapes it takes) and `config` (the config class whose
    fields the tuning is) complete the docstrings."""
    static = ("scale", "use_qk_l2norm", "state_layout", "chunk_size", "interpret", *tuning_keys)

    def gated_delta_rule(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
                         checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", chunk_size=64,
                         interpret=False, **tuning):
        return run_checked(pipeline, supports, q, k, v, g, beta, per_channel_decay=False, scale=scale,
                           use_qk_l2norm=use_qk_l2norm, initial_state=initial_state, cu_seqlens=cu_seqlens,
                           checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                           state_layout=state_layout, chunk_size=chunk_size, interpret=interpret, **tuning)

    def kda(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
            checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", chunk_size=64, interpret=False,
            A_log=None, dt_bias=None, lower_bound=None, **tuning):
        gate = functools.partial(kda_gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
        return run_checked(pipeline, supports, q, k, v, g, beta, per_channel_decay=True, scale=scale,
                           use_qk_l2norm=use_qk_l2norm, initial_state=initial_state, cu_seqlens=cu_seqlens,
                           checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                           state_layout=state_layout, chunk_size=chunk_size, interpret=interpret, gate=gate,
                           **tuning)

    gated_delta_rule.__doc__ = _GDN_DOC.format(inputs=inputs, config=config)
    kda.__doc__ = _KDA_DOC
    for entry in (gated_delta_rule, kda):
        entry.__module__ = pipeline.__module__
    return (jax.jit(gated_delta_rule, static_argnames=static),
            jax.jit(kda, static_argnames=(*static, "lower_bound")))
