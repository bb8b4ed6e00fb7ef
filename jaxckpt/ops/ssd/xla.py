"""Chunk-parallel Mamba2 SSD in plain JAX (XLA): outputs, final states and prefill checkpoints in one pass.

The chunked SSD form (kernels.md §2.1; derivation in README.md): per chunk the local decay cumsum, the masked
intra-chunk product (L o C B^T) (delta x), the local end-of-chunk state, the state carried across chunks, and the
inter-chunk readout exp(Acs_i) H_c C_i. Rows are packed into chunks by the device-side `chunk_layout`, so the whole op
works under `jax.jit` with traced `cu_seqlens` / checkpoint arrays (static shapes, no host sync) and is
differentiable with `jax.grad`.

The carry across chunks is affine with a scalar map per head, H_out = exp(Acs_last) H_in + local, so the default
`state_pass="associative"` runs it as a parallel prefix scan (`jaxckpt.ops.common.affine_scan`; elementwise, about
2 log2(NC) dependent levels) instead of one `lax.scan` step per chunk of every row in sequence ("sequential", kept for
comparison): on a GPU each scan step is a few tiny kernels, and NC reaches 512 at T = 32768, C = 64.

Precision follows x, B and C (`affine_scan.matmul_policy`): fp32 (float64 for float64 x) at HIGHEST matmul precision
unless all three are 16-bit; then the products take bf16 operands with fp32 accumulation (tensor cores; y in the bf16
class, rel-RMS <= 6e-3), except those that build states (local states, checkpoint sums), which use bf16x3 and stay
near fp32 accuracy. y comes back in x.dtype, states in the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxckpt.ops.common.affine_scan import affine_scan, matmul_policy
from jaxckpt.ops.common.log_decay import pair_log_decays, suffix_log_decays
from jaxckpt.ops.common.xla_arrays import check_ssd_inputs, compute_dtype, packed_metadata, ssd_delta, ssd_initial_state
from jaxckpt.plan.conventions import check_positive, check_state_layout
from jaxckpt.plan.layout import chunk_layout

CHECKPOINT_METHODS = ("in_chunk", "forced_break")
STATE_PASSES = ("associative", "sequential")


def differentiable(**call) -> bool:
    """Plain jnp/lax: JAX differentiates through every call (`jaxckpt.ops.common.api` wraps the kernels that it
    cannot)."""
    return True


def ssd(x, dt, A, B, C, *, D=None, dt_bias=None, z=None, dt_limit=None, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="vk", chunk_size=64,
        checkpoint_method="in_chunk", state_pass="associative"):
    """Chunked SSD scan of packed rows with final and checkpoint states.

    x [T, H, P]; dt [T, H] raw (delta = softplus(dt + dt_bias), then clamped to dt_limit = (lo, hi) when given);
    A [H]; B, C [T, G, N] with G dividing H (head h reads group h // (H // G)); D [H] or [H, P] (None = 0);
    z [T, H, P] gate (y * silu(z)); initial_state [N_rows, H, P, N] ("vk") or [N_rows, H, N, P] ("kv"), None = zeros;
    cu_seqlens i32[N_rows + 1] (None = one row); checkpoint_cu i32[N_rows + 1] + checkpoint_offsets i32[M] (CSR).

    `checkpoint_method="in_chunk"` keeps the chunk grid anchored at each row start and reads a checkpoint inside its
    chunk (outputs and final states are bitwise independent of the checkpoints); "forced_break" starts a new chunk
    at every checkpoint and emits the carried state there. `state_pass="associative"` carries the state across chunks
    with a parallel prefix scan over the chunk affine maps, "sequential" with one `lax.scan` step per chunk.

    Returns (y [T, H, P] in x.dtype, final_state [N_rows, H, P, N], checkpoint_states [M, H, P, N]) (states
    [.., H, N, P] for "kv", fp32 or float64 for float64 x). Padding tokens past cu_seqlens[N] and padded checkpoint
    entries are zeros. Metadata values are not checked here (callers run `jaxckpt.plan.conventions.validate_*`).
    """
    check_state_layout(state_layout)
    chunk_size = check_positive(chunk_size, name="chunk_size")
    if checkpoint_method not in CHECKPOINT_METHODS:
        raise ValueError(f"checkpoint_method: must be one of {CHECKPOINT_METHODS}, got {checkpoint_method!r}")
    if state_pass not in STATE_PASSES:
        raise ValueError(f"state_pass: must be one of {STATE_PASSES}, got {state_pass!r}")
    (x, dt, A, B, C, D, dt_bias, z), dims = check_ssd_inputs(x, dt, A, B, C, D=D, dt_bias=dt_bias, z=z)
    num_tokens, num_heads, head_dim, num_groups, state_dim = dims
    cdt = compute_dtype(x.dtype)
    dot, state_dot = matmul_policy(x.dtype, B.dtype, C.dtype)
    if D is not None:
        D = D.astype(cdt).reshape(num_heads, -1)
    cu, ccu, offsets = packed_metadata(cu_seqlens, checkpoint_cu, checkpoint_offsets, num_tokens)
    num_rows = cu.shape[0] - 1
    initial = ssd_initial_state(initial_state, dims, num_rows, state_layout, cdt)
    if initial is None:
        initial = jnp.zeros((num_rows, num_heads, head_dim, state_dim), cdt)
    delta = ssd_delta(dt, dt_bias, dt_limit, cdt)  # [T, H]

    forced = checkpoint_method == "forced_break"
    layout = chunk_layout(cu, ccu, offsets, chunk_size=chunk_size, num_tokens=num_tokens, forced_breaks=forced,
                          xp=jnp)
    num_chunks = layout.chunk_len.shape[0]
    reps = num_heads // num_groups
    pos = jnp.arange(chunk_size, dtype=jnp.int32)
    chunk_tokens = jnp.clip(layout.chunk_start[:, None] + pos, 0, max(num_tokens - 1, 0))  # i32[NC, C]
    in_chunk = pos < layout.chunk_len[:, None]  # bool[NC, C]

    def to_chunks(array):  # [T, ...] -> [NC, C, ...] in the compute dtype, zeros past the chunk's tokens
        if num_tokens == 0:
            return jnp.zeros((num_chunks, chunk_size) + array.shape[1:], cdt)
        chunks = array[chunk_tokens].astype(cdt)
        # selected, not multiplied: the next row's or the padding's NaN must not reach this chunk
        return jnp.where(in_chunk.reshape(in_chunk.shape + (1,) * (chunks.ndim - 2)), chunks, 0)

    # padding slots get delta = 0: no decay, no input, so they are no-ops for every state and cumsum
    delta_c = to_chunks(delta)  # [NC, C, H]
    x_c = to_chunks(x)  # [NC, C, H, P]
    B_c = to_chunks(B)  # [NC, C, G, N]
    C_c = to_chunks(C)  # [NC, C, G, N]
    # delta A per token, [NC, H, C, 1]; selected on padding slots too, where delta = 0 and A = -inf would give NaN
    dA = jnp.where(in_chunk[:, None, :, None], jnp.swapaxes(delta_c, 1, 2)[..., None] * A.astype(cdt)[:, None, None],
                   0)
    acs = jnp.cumsum(dA[..., 0], axis=2)  # [NC, H, C] chunk-local
    xdt = (x_c * delta_c[..., None]).reshape(num_chunks, chunk_size, num_groups, reps, head_dim)  # [NC, C, G, R, P]

    L = jnp.exp(pair_log_decays(dA)[..., 0])  # [NC, H, C, C]
    CB = dot("kign,kjgn->kgij", C_c, B_c)  # [NC, G, C, C]
    scores = L.reshape(num_chunks, num_groups, reps, chunk_size, chunk_size) * CB[:, :, None]
    y_intra = dot("kgrij,kjgrp->kigrp", scores, xdt)  # [NC, C, G, R, P]

    to_end = jnp.exp(suffix_log_decays(dA)[..., 0]).swapaxes(1, 2).reshape(num_chunks, chunk_size, num_groups, reps)
    local = state_dot("kjgrp,kjgn->kgrpn", to_end[..., None] * xdt, B_c)
    local = local.reshape(num_chunks, num_heads, head_dim, state_dim)  # [NC, H, P, N] chunk-local end state
    chunk_decay = jnp.exp(acs[:, :, -1])  # [NC, H]

    first = layout.chunk_first[:, None, None, None]
    initial_c = initial[layout.chunk_row]  # [NC, H, P, N]
    if state_pass == "sequential":
        def step(carry, chunk):
            first, row, decay, update = chunk
            entering = jnp.where(first, initial[row], carry)
            carry = decay[:, None, None] * entering + update
            return carry, carry

        _, after = lax.scan(step, jnp.zeros_like(initial[0]),
                            (layout.chunk_first, layout.chunk_row, chunk_decay, local))
    else:
        # a row's first chunk reads its initial state instead of the carry: the scan cuts there, its offset holds
        # the start
        decay = chunk_decay[:, :, None, None]  # [NC, H, 1, 1]
        after = affine_scan(decay, local + decay * jnp.where(first, initial_c, 0), layout.chunk_first,
                            apply=jnp.multiply)
    # [NC, H, P, N] the state after / entering each chunk
    states = jnp.where(first, initial_c, jnp.concatenate([jnp.zeros_like(after[:1]), after[:-1]], axis=0))

    states_g = states.reshape(num_chunks, num_groups, reps, head_dim, state_dim)
    y_inter = dot("kgrpn,kign->kigrp", states_g, C_c)
    y_inter = y_inter * jnp.exp(jnp.swapaxes(acs, 1, 2)).reshape(num_chunks, chunk_size, num_groups, reps)[..., None]
    y_c = (y_intra + y_inter).reshape(num_chunks, chunk_size, num_heads, head_dim)
    y = y_c[layout.token_chunk, layout.token_pos]  # [T, H, P]
    if D is not None:
        y = y + D * x.astype(cdt)
    if z is not None:
        y = y * jax.nn.silu(z.astype(cdt))
    y = jnp.where(layout.token_valid[:, None, None], y, 0).astype(x.dtype)

    last = jnp.maximum(layout.row_first_chunk + layout.row_num_chunks - 1, 0)
    final_state = jnp.where((layout.row_num_chunks > 0)[:, None, None, None], after[last], initial)

    c, r = layout.checkpoint_chunk, layout.checkpoint_pos
    if forced:
        checkpoint_states = states[c]
    else:
        # state after the first r tokens of chunk c: exp(Acs_{r-1}) H_c + sum_{i<r} exp(Acs_{r-1} - Acs_i) xdt_i B_i^T
        acs_k = acs[c]  # [M, H, C]
        ref = jnp.where((r > 0)[:, None], jnp.take_along_axis(acs_k, jnp.maximum(r - 1, 0)[:, None, None],
                                                                axis=2)[..., 0], 0)  # [M, H]
        before = (pos < r[:, None])[:, None, :, None]  # [M, 1, C, 1]
        to_r = suffix_log_decays(jnp.where(before, dA[c], 0))  # [M, H, C, 1] Acs_{r-1} - Acs_i over (i, r - 1]
        weights = jnp.exp(jnp.where(before, to_r, -jnp.inf))[..., 0]  # [M, H, C]
        weights = weights.swapaxes(1, 2).reshape(-1, chunk_size, num_groups, reps, 1)
        within = state_dot("mjgrp,mjgn->mgrpn", weights * xdt[c], B_c[c])
        checkpoint_states = jnp.exp(ref)[..., None, None] * states[c] + within.reshape(states[c].shape)
    checkpoint_states = jnp.where(layout.checkpoint_valid[:, None, None, None], checkpoint_states, 0)
    if state_layout == "kv":
        final_state = jnp.swapaxes(final_state, -1, -2)
        checkpoint_states = jnp.swapaxes(checkpoint_states, -1, -2)
    return y, final_state, checkpoint_states
