"""Checkpointed GDN and KDA prefill over fla-core 0.6.0's chunk kernels, which return only final states.

Two ways, both planned on the host from `jaxckpt.plan` (no device sync inside the forward beyond reading the index
arguments once):

- Split at the checkpoint (`*_split`, alignment 1, any offset): `jaxckpt.plan.layout.split_layout` cuts every row at
  its checkpoints; launch j runs segment j of every row that has one, packed as one varlen call (B = 1, int64
  `cu_seqlens`). Launch 0 starts from the rows' initial states, launch j > 0 from launch j - 1's final states, which
  are the checkpoints. k checkpoints in a row cost k + 1 dependent launches for the whole batch, never one call per
  request, and no token is computed twice (vLLM's planner reruns the tails instead, kernels.md / vllm brief §5.4).
  Outputs are scattered back by token index.
- KDA intermediate states (`chunk_kda_native`, alignment 64): one `chunk_kda(..., return_intermediate_states=True)`
  call gives h [NT, HV, K, V] in bf16, the state entering each 64-token chunk, chunks counted from each row's start;
  the checkpoint at offset p (p % 64 == 0) of row n is h[first chunk of row n + p / 64]. Offsets off the grid raise
  before any launch. These checkpoints carry bf16 rounding (the split way's are fp32 final states).

The FLA function is looked up on first use; every entry takes `kernel=` to run another callable with FLA's signature
(the tests inject a float64 torch recurrence). Inputs are FLA's `[1, T, H, K]` or packed `[T, H, K]`; the output
keeps the input's rank. `initial_state` is fp32 [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk", FLA's
`state_v_first=True`). The paged forms gather initial states from, and write final and checkpoint states into,
vLLM-style pools through `torch_bridge.interop` (`index_copy_`; -1 and the null slot skipped).

Model options carry jaxckpt's names (`jaxckpt.ops.gated_delta_rule` / `kda`) and reach FLA under its own, in every
launch: `use_qk_l2norm` -> `use_qk_l2norm_in_kernel`; KDA's gate `A_log`, `dt_bias`, `lower_bound` -> the same names
plus `use_gate_in_kernel=True` when `A_log` or `lower_bound` is given. Both act per token, so cutting a row at its
checkpoints does not change them. FLA's other keywords are not taken (a TypeError): `chunk_size` would move the
native path's 64-token grid, `cp_context`, `use_graph`, `chunk_indices` and `disable_recompute` do not fit launches
planned here for inference, and the beta and `safe_gate` switches have no jaxckpt counterpart to test against.
"""

from __future__ import annotations

import numpy as np
import torch

from jaxckpt.plan.checks import check_kda_gate
from jaxckpt.plan.conventions import check_state_layout
from jaxckpt.plan.layout import chunk_layout, split_layout
from torch_bridge.interop import check_pool, check_tensor, gather_states, host_metadata, pool_slots, write_states
from torch_bridge.spec import FLA_KDA_ALIGNMENT


def _fla_gdn():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def _fla_kda():
    from fla.ops.kda import chunk_kda

    return chunk_kda


def _fla_options(*, per_channel: bool, g, device, use_qk_l2norm: bool, A_log, dt_bias, lower_bound) -> dict:
    """The user's model options under FLA's keyword names, checked here (g is the gate [T, HV, K]) because FLA's Triton
    gate would read a wrong-sized A_log or dt_bias out of bounds instead of raising."""
    options = dict(use_qk_l2norm_in_kernel=use_qk_l2norm)
    if not per_channel:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if value is not None:
                raise ValueError(f"{name}: the fused gate is KDA's (per_channel); GDN's g is the log decay itself")
        return options
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t is not None:
            check_tensor(t, device, name=name, device_of="q")
    check_kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    gated = A_log is not None or lower_bound is not None
    # FLA's Triton gate reads A_log and dt_bias by pointer as dense rows
    dense = lambda t: None if t is None else t.contiguous()  # noqa: E731
    return dict(options, use_gate_in_kernel=gated, A_log=dense(A_log), dt_bias=dense(dt_bias),
                lower_bound=lower_bound)


class _Inputs:
    """Checked token inputs in FLA's [1, T, ...] form, the host metadata, the state shape and FLA's keywords."""

    def __init__(self, q, k, v, g, beta, *, per_channel: bool, cu_seqlens, checkpoint_cu, checkpoint_offsets,
                 state_layout: str, use_qk_l2norm: bool, A_log, dt_bias, lower_bound):
        check_state_layout(state_layout)
        if not isinstance(q, torch.Tensor):
            raise ValueError(f"q: expected a torch.Tensor, got {type(q).__name__}")
        if q.ndim not in (3, 4) or (q.ndim == 4 and q.shape[0] != 1):
            raise ValueError(f"q: expected [T, H, K] or [1, T, H, K] (varlen rows packed, B = 1), got shape "
                             f"{tuple(q.shape)}")
        self.batched = q.ndim == 4
        lift = (lambda t: t) if self.batched else (lambda t: t.unsqueeze(0))
        named = dict(q=q, k=k, v=v, g=g, beta=beta)
        for name, t in named.items():
            check_tensor(t, q.device, name=name, device_of="q")
        for name in ("k", "v"):
            if named[name].dtype != q.dtype:
                raise ValueError(f"{name}: dtype {named[name].dtype} differs from q's {q.dtype}")
        q, k, v, g, beta = (lift(t) for t in (q, k, v, g, beta))
        _, num_tokens, num_heads, dim_k = q.shape
        if k.shape != q.shape:
            raise ValueError(f"k: expected the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
        if v.ndim != 4 or v.shape[1] != num_tokens or v.shape[2] % num_heads:
            raise ValueError(f"v: expected [T, HV, V] with T={num_tokens} and HV a multiple of H={num_heads}, got "
                             f"shape {tuple(v.shape)}")
        num_v_heads, dim_v = v.shape[2:]
        g_shape = (1, num_tokens, num_v_heads) + ((dim_k,) if per_channel else ())
        if tuple(g.shape) != g_shape:
            raise ValueError(f"g: expected [T, HV{', K' if per_channel else ''}] = {g_shape[1:]}, got shape "
                             f"{tuple(g.shape)}")
        if tuple(beta.shape) != (1, num_tokens, num_v_heads):
            raise ValueError(f"beta: expected [T, HV] = {(num_tokens, num_v_heads)}, got shape {tuple(beta.shape)}")
        self.tokens = (q, k, v, g, beta)
        self.device = q.device
        self.num_tokens = num_tokens
        self.out_shape = (1, num_tokens, num_v_heads, dim_v)
        self.out_dtype = q.dtype
        self.state_shape = (num_v_heads, dim_k, dim_v) if state_layout == "kv" else (num_v_heads, dim_v, dim_k)
        self.cu, self.ccu, self.offsets = host_metadata(num_tokens, cu_seqlens, checkpoint_cu, checkpoint_offsets)
        self.num_rows = self.cu.size - 1
        self.fla_options = _fla_options(per_channel=per_channel, g=g[0], device=q.device, use_qk_l2norm=use_qk_l2norm,
                                        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
        if state_layout == "vk":
            self.fla_options["state_v_first"] = True

    def initial(self, initial_state) -> torch.Tensor:
        shape = (self.num_rows, *self.state_shape)
        if initial_state is None:
            return torch.zeros(shape, dtype=torch.float32, device=self.device)
        if not isinstance(initial_state, torch.Tensor):
            raise ValueError(f"initial_state: expected a torch.Tensor, got {type(initial_state).__name__}")
        if initial_state.device != self.device:
            raise ValueError(f"initial_state: on {initial_state.device}, expected the device of q ({self.device})")
        if initial_state.dtype != torch.float32:
            raise ValueError(f"initial_state: dtype must be float32 (FLA keeps states in fp32), got "
                             f"{initial_state.dtype}")
        if tuple(initial_state.shape) != shape:
            raise ValueError(f"initial_state: expected [N, HV, ., .] = {shape}, got shape "
                             f"{tuple(initial_state.shape)}")
        return initial_state

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return o if self.batched else o[0]


def _long(array, device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(array, np.int64), device=device)


def _split(kernel, inputs: _Inputs, states: torch.Tensor, *, scale):
    """Runs the split launches; `states` [N, ...] fp32 holds the initial states and is updated to the finals."""
    device = inputs.device
    o = torch.zeros(inputs.out_shape, dtype=inputs.out_dtype, device=device)
    checkpoint_states = torch.zeros((inputs.offsets.size, *inputs.state_shape), dtype=torch.float32, device=device)
    for launch in split_layout(inputs.cu, inputs.ccu, inputs.offsets):
        lengths = np.diff(launch.cu_seqlens)
        # only an empty row has an empty segment; its final state is its initial state
        keep = lengths > 0
        if not keep.any():
            continue
        seg_cu = np.concatenate([[0], np.cumsum(lengths[keep])])
        rows = _long(launch.rows[keep], device)
        tokens = _long(launch.token_indices, device)
        seg_o, seg_final = kernel(*(t.index_select(1, tokens) for t in inputs.tokens), scale=scale,
                                  initial_state=states.index_select(0, rows).contiguous(), output_final_state=True,
                                  cu_seqlens=_long(seg_cu, device), cu_seqlens_cpu=torch.as_tensor(seg_cu),
                                  **inputs.fla_options)[:2]
        o.index_copy_(1, tokens, seg_o.to(o.dtype))
        seg_final = seg_final.float()
        states.index_copy_(0, rows, seg_final)
        ids = launch.checkpoint_ids[keep]
        has = ids >= 0
        if has.any():
            checkpoint_states.index_copy_(0, _long(ids[has], device),
                                          seg_final.index_select(0, _long(np.nonzero(has)[0], device)))
    return o, checkpoint_states


def split_prefill(kernel, q, k, v, g, beta, *, per_channel: bool, scale=None, use_qk_l2norm: bool = False,
                  initial_state=None, cu_seqlens=None, checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv",
                  A_log=None, dt_bias=None, lower_bound=None):
    """Split-at-checkpoint prefill through `kernel` (FLA's signature); returns (o, final_state, checkpoint_states).

    q, k [T, H, K] (or [1, T, H, K]); v [T, HV, V]; g [T, HV] (GDN) or [T, HV, K] (KDA, `per_channel`); beta [T, HV];
    cu_seqlens i32/i64[N + 1]; checkpoint_cu i32[N + 1] + checkpoint_offsets i32[M] (CSR, any offset in (0, len)).
    scale: q's factor, None = K**-0.5. use_qk_l2norm: L2-normalize q and k per head inside the kernel (FLA's
    `use_qk_l2norm_in_kernel`). KDA only (`per_channel`), the fused gate of `jaxckpt.ops.kda`: with A_log [HV] the
    raw g becomes -exp(A_log) * softplus(g + dt_bias); with lower_bound in [-5, 0) the bounded gate
    lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (A_log None: lower_bound * sigmoid(g + dt_bias)); dt_bias
    [HV, K] or [HV * K], None = 0. Without A_log and lower_bound, g is the log decay itself.
    final_state and checkpoint_states are fp32; padded CSR entries give zero rows, padding tokens zero outputs.
    """
    inputs = _Inputs(q, k, v, g, beta, per_channel=per_channel, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                     checkpoint_offsets=checkpoint_offsets, state_layout=state_layout, use_qk_l2norm=use_qk_l2norm,
                     A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    states = inputs.initial(initial_state).clone()
    o, checkpoint_states = _split(kernel, inputs, states, scale=scale)
    return inputs.output(o), states, checkpoint_states


def chunk_gated_delta_rule_split(q, k, v, g, beta, *, scale=None, use_qk_l2norm: bool = False, initial_state=None,
                                 cu_seqlens=None, checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv",
                                 kernel=None):
    """GDN over FLA's `chunk_gated_delta_rule`, split at the checkpoints (see `split_prefill`)."""
    return split_prefill(kernel or _fla_gdn(), q, k, v, g, beta, per_channel=False, scale=scale,
                         use_qk_l2norm=use_qk_l2norm, initial_state=initial_state, cu_seqlens=cu_seqlens,
                         checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, state_layout=state_layout)


def chunk_kda_split(q, k, v, g, beta, *, scale=None, use_qk_l2norm: bool = False, initial_state=None, cu_seqlens=None,
                    checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", A_log=None, dt_bias=None,
                    lower_bound=None, kernel=None):
    """KDA over FLA's `chunk_kda`, split at the checkpoints (see `split_prefill`, gate options included)."""
    return split_prefill(kernel or _fla_kda(), q, k, v, g, beta, per_channel=True, scale=scale,
                         use_qk_l2norm=use_qk_l2norm, initial_state=initial_state, cu_seqlens=cu_seqlens,
                         checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, state_layout=state_layout,
                         A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)


def _native_plan(inputs: _Inputs) -> np.ndarray:
    """Index into FLA's h of every real checkpoint; raises before any launch for offsets off the 64 grid."""
    num_real = int(inputs.ccu[-1])
    real = inputs.offsets[:num_real]
    bad = real % FLA_KDA_ALIGNMENT != 0
    if np.any(bad):
        raise ValueError(f"checkpoint_offsets: offset {int(real[bad][0])} is not a multiple of the alignment "
                         f"{FLA_KDA_ALIGNMENT} (FLA's KDA chunk: its intermediate states lie on that grid)")
    layout = chunk_layout(inputs.cu, inputs.ccu, inputs.offsets, chunk_size=FLA_KDA_ALIGNMENT,
                          num_tokens=inputs.num_tokens)
    return np.asarray(layout.checkpoint_chunk)[:num_real]


def _native(kernel, inputs: _Inputs, initial: torch.Tensor, *, scale):
    chunks = _native_plan(inputs)
    device = inputs.device
    # FLA hands out h only in inference mode (it bypasses autograd); o comes back as an inference tensor
    with torch.inference_mode():
        o, final, h = kernel(*inputs.tokens, scale=scale, initial_state=initial, output_final_state=True,
                             return_intermediate_states=True, cu_seqlens=_long(inputs.cu, device),
                             cu_seqlens_cpu=torch.as_tensor(inputs.cu, dtype=torch.int64), **inputs.fla_options)
    if h.ndim == 5:
        h = h[0]
    checkpoint_states = torch.zeros((inputs.offsets.size, *inputs.state_shape), dtype=torch.float32, device=device)
    if chunks.size:
        checkpoint_states[:chunks.size] = h.index_select(0, _long(chunks, device)).float()
    # a row without tokens keeps its initial state (FLA gives such rows no chunk)
    empty = _long(np.nonzero(np.diff(inputs.cu) == 0)[0], device)
    final = final.float().clone()
    if empty.numel():
        final.index_copy_(0, empty, initial.index_select(0, empty))
    return o, final, checkpoint_states


def chunk_kda_native(q, k, v, g, beta, *, scale=None, use_qk_l2norm: bool = False, initial_state=None, cu_seqlens=None,
                     checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", A_log=None, dt_bias=None,
                     lower_bound=None, kernel=None):
    """KDA with checkpoints read from FLA's intermediate states: one launch, offsets on the 64-token grid only.

    Arguments (gate options included) and returns as `split_prefill`; checkpoint_states are fp32 tensors holding
    FLA's bf16 states.
    """
    inputs = _Inputs(q, k, v, g, beta, per_channel=True, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                     checkpoint_offsets=checkpoint_offsets, state_layout=state_layout, use_qk_l2norm=use_qk_l2norm,
                     A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    initial = inputs.initial(initial_state)
    _native_plan(inputs)
    o, final, checkpoint_states = _native(kernel or _fla_kda(), inputs, initial, scale=scale)
    return inputs.output(o), final, checkpoint_states


def _paged(run, inputs: _Inputs, state_pool, slot_args: dict):
    check_pool(state_pool, inputs.state_shape, inputs.device)
    slots = pool_slots(state_pool.shape[0], inputs.num_rows, inputs.ccu, inputs.offsets.size, **slot_args)
    o, final, checkpoint_states = run(gather_states(state_pool, slots.initial))
    write_states(state_pool, slots.final, final)
    write_states(state_pool, slots.checkpoint, checkpoint_states)
    return inputs.output(o)


def _slot_args(initial_state_indices, has_initial_state, final_state_indices, checkpoint_state_indices) -> dict:
    return dict(initial_state_indices=initial_state_indices, has_initial_state=has_initial_state,
                final_state_indices=final_state_indices, checkpoint_state_indices=checkpoint_state_indices)


def split_prefill_paged(kernel, q, k, v, g, beta, state_pool, *, per_channel: bool, initial_state_indices,
                        has_initial_state, final_state_indices, checkpoint_state_indices=None, scale=None,
                        use_qk_l2norm: bool = False, cu_seqlens=None, checkpoint_cu=None, checkpoint_offsets=None,
                        state_layout="kv", A_log=None, dt_bias=None, lower_bound=None):
    """`split_prefill` over a pool [S, HV, ., .] (fp32/bf16/fp16): reads initial states, writes final and checkpoint
    states in place (vLLM -1 / null slots skipped, padded CSR entries skipped). Returns o.

    initial_state_indices, has_initial_state, final_state_indices  # i32[N], bool[N], i32[N]
    checkpoint_state_indices                                       # i32[M]
    Model options (scale, use_qk_l2norm, KDA's A_log, dt_bias, lower_bound) as `split_prefill`.
    All slots are validated before the first launch; a bad one raises ValueError and nothing is written.
    """
    inputs = _Inputs(q, k, v, g, beta, per_channel=per_channel, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                     checkpoint_offsets=checkpoint_offsets, state_layout=state_layout, use_qk_l2norm=use_qk_l2norm,
                     A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)

    def run(initial):
        o, checkpoint_states = _split(kernel, inputs, initial, scale=scale)
        return o, initial, checkpoint_states

    return _paged(run, inputs, state_pool, _slot_args(initial_state_indices, has_initial_state, final_state_indices,
                                                      checkpoint_state_indices))


def chunk_gated_delta_rule_split_paged(q, k, v, g, beta, state_pool, *, initial_state_indices, has_initial_state,
                                       final_state_indices, checkpoint_state_indices=None, scale=None,
                                       use_qk_l2norm: bool = False, cu_seqlens=None, checkpoint_cu=None,
                                       checkpoint_offsets=None, state_layout="kv", kernel=None):
    """GDN split at the checkpoints over a state pool (see `split_prefill_paged`)."""
    return split_prefill_paged(kernel or _fla_gdn(), q, k, v, g, beta, state_pool, per_channel=False,
                               initial_state_indices=initial_state_indices, has_initial_state=has_initial_state,
                               final_state_indices=final_state_indices,
                               checkpoint_state_indices=checkpoint_state_indices, scale=scale,
                               use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                               checkpoint_offsets=checkpoint_offsets, state_layout=state_layout)


def chunk_kda_split_paged(q, k, v, g, beta, state_pool, *, initial_state_indices, has_initial_state,
                          final_state_indices, checkpoint_state_indices=None, scale=None, use_qk_l2norm: bool = False,
                          cu_seqlens=None, checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", A_log=None,
                          dt_bias=None, lower_bound=None, kernel=None):
    """KDA split at the checkpoints over a state pool (see `split_prefill_paged`)."""
    return split_prefill_paged(kernel or _fla_kda(), q, k, v, g, beta, state_pool, per_channel=True,
                               initial_state_indices=initial_state_indices, has_initial_state=has_initial_state,
                               final_state_indices=final_state_indices,
                               checkpoint_state_indices=checkpoint_state_indices, scale=scale,
                               use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                               checkpoint_offsets=checkpoint_offsets, state_layout=state_layout, A_log=A_log,
                               dt_bias=dt_bias, lower_bound=lower_bound)


def chunk_kda_native_paged(q, k, v, g, beta, state_pool, *, initial_state_indices, has_initial_state,
                           final_state_indices, checkpoint_state_indices=None, scale=None,
                           use_qk_l2norm: bool = False, cu_seqlens=None, checkpoint_cu=None, checkpoint_offsets=None,
                           state_layout="kv", A_log=None, dt_bias=None, lower_bound=None, kernel=None):
    """`chunk_kda_native` over a state pool, as `split_prefill_paged`; offsets must lie on the 64-token grid."""
    inputs = _Inputs(q, k, v, g, beta, per_channel=True, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                     checkpoint_offsets=checkpoint_offsets, state_layout=state_layout, use_qk_l2norm=use_qk_l2norm,
                     A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    _native_plan(inputs)
    fn = kernel or _fla_kda()
    return _paged(lambda initial: _native(fn, inputs, initial, scale=scale), inputs, state_pool,
                  _slot_args(initial_state_indices, has_initial_state, final_state_indices,
                             checkpoint_state_indices))
