"""Chunk-parallel gated delta rule (GDN and KDA) in plain jnp/lax, exporting checkpoint states in the same pass.

The portable XLA path behind `jaxckpt.ops.delta_rule.xla` (GDN and KDA): chunk-local WY/UT form (FLA's
`chunk_gated_delta_rule` / `chunk_kda`, derivation in the ops' README.md), with every intra-chunk product batched over
chunks and heads. The fp32 state crosses chunks by a parallel prefix scan over the chunks' affine state maps
(`jaxckpt.ops.common.affine_scan`, the default `state_pass="associative"`) or by one `lax.scan` step per chunk
(`state_pass="sequential"`); outputs, final states and checkpoints are then read in parallel from the state entering
each chunk. Packed varlen rows are gathered into padded chunks from the `jaxckpt.plan.layout.chunk_layout` table built
on device, so cu_seqlens and the CSR checkpoint arrays may be traced: a new batch of the same shapes reuses the
compiled program. Plain jnp/lax only, so `jax.grad` works.

Precision follows q, k and v (`affine_scan.matmul_policy`). Any of them wider than 16 bits: every matmul at
`Precision.HIGHEST` (TF32 on GPUs would break the fp32 accuracy class, rel-RMS <= 1e-5 against float64). All 16-bit:
bf16 operands with fp32 accumulation for the scores, the chunk maps, v_new and the outputs, and bf16x3 (split into
high and low bf16 parts) for the products that feed the state: the chunk offsets, the map compositions and the
checkpoint sums (the bf16 class, rel-RMS <= 6e-3). Decays, the triangular solve, states and everything elementwise stay
fp32 either way.
The log decays g must be <= 0 (every gate formula produces that): the intra-chunk factorisations below rely on
exp(G_i - G_j) <= 1 for j <= i.

Performance notes (XLA:CPU on the shared 2-core dev box, jax 0.11.2, fp32; timings are the mean of 5 warm runs):
- KDA pairwise decays. The intra-chunk scores sum_c a_ic b_jc exp(G_ic - G_jc) need a decay per (i, j, c). For
  32 chunks x 4 heads at C = 64, K = 128, building the full [C, C, K] masked decay tensor and contracting it costs
  333 ms (einsum) / 180 ms (broadcast-multiply-sum); the reference-row factorisation used here (`_channel_scores`:
  exact pairwise decays only inside diagonal sub-blocks of `SUB_BLOCK` rows, one rank-K matmul per row block against
  keys pre-decayed to the block's first row) costs 41 ms at sub-block 8 (48 ms at 4, 56 ms at 16, 164 ms at 32), at
  the same accuracy (rel-RMS 7e-8 vs 3e-8 against the direct form).
- q and k scores in one call. A (k against k) and A_qk (q against k) share the right operand and every decay factor,
  so they are computed as one stacked operation; that also cut the compile time of a whole op from 2.3-3.0 s to about
  1.6 s (most of XLA:CPU's compile time is LLVM optimisation: `--xla_backend_optimization_level=0` takes it to ~1 s).
- UT transform (by construction, not timed). One unit-lower triangular solve against [beta exp(G) K | beta V] gives
  W and U at once; forming T = (I + A)^-1 first would add two C x C matmuls per chunk.

GPU notes (H200, bf16 q/k/v, K = V = 128, HV = H): before this state pass and precision policy, GDN on this path
ran well behind jla's plain-JAX chunked path at the three anchor shapes (bench/README.md, "Portable XLA path").
Two causes, and what replaced them:
- The sequential pass ran one `lax.scan` step, a few small kernels, per chunk of every row in sequence: 512 dependent
  steps at T = 32768, C = 64, and also 512 for 8 independent rows of 4096. The associative pass needs about
  2 log2(NC) dependent levels (18 at NC = 512). It costs the map products instead: M_c = diag(exp(G_last)) -
  Ktil^T W is K x K, and the up-sweep composes about NC of them (K^3 each), with about 2 NC map-offset products
  (K^2 V); XLA drops the down-sweep's unused map products. The maps take NC x HV x K x K fp32 (0.5 GB at
  T = 32768, HV = 16, K = 128; 1 GB at 8 x 4096 with HV = 32), plus a scan level's worth of temporaries.
- Every matmul ran at HIGHEST in fp32 (no tensor cores), bf16 inputs included; now those take bf16 tensor-core
  products. bf16x3 costs three bf16 matmuls where it is used; plain bf16 in the compositions was measured (CPU,
  one row, T = 8192, HV = 2, g ~ -0.001 per token) to double the state error against float64 (1.5e-3 -> 3.3e-3) and
  push o to 4.4e-3, while bf16x3 keeps the associative pass as accurate as the sequential one (o 3.5e-3, states
  1.5e-3; bf16x3 offsets alone cut the final-state error 4x against plain bf16 ones).
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from jaxckpt.ops.common.affine_scan import affine_scan, matmul_policy
from jaxckpt.ops.common.log_decay import pair_log_decays, suffix_log_decays
from jaxckpt.ops.common.xla_arrays import check_float, packed_metadata
from jaxckpt.plan.checks import delta_dims
from jaxckpt.plan.conventions import check_positive, check_state_layout
from jaxckpt.plan.layout import chunk_layout

CHECKPOINT_METHODS = ("in_chunk", "forced_break")
STATE_PASSES = ("associative", "sequential")
L2NORM_EPS = 1e-6
SUB_BLOCK = 8


def check_static(q, k, v, g, beta, *, per_channel_decay: bool, scale, initial_state, cu_seqlens, checkpoint_cu,
                 checkpoint_offsets, state_layout: str, chunk_size: int, checkpoint_method: str,
                 state_pass: str = "associative"):
    """Trace-time checks of shapes, dtypes and options (concrete metadata is validated by the caller)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_float(x, name=name)
    _, _, head_k, num_v_heads, head_v = delta_dims(q, k, v, g, beta, per_channel_decay=per_channel_decay)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale)):
        raise ValueError(f"scale: must be a finite Python number (a static option), got {scale!r}")
    check_state_layout(state_layout)
    check_positive(chunk_size, name="chunk_size")
    if checkpoint_method not in CHECKPOINT_METHODS:
        raise ValueError(f"checkpoint_method: must be one of {CHECKPOINT_METHODS}, got {checkpoint_method!r}")
    if state_pass not in STATE_PASSES:
        raise ValueError(f"state_pass: must be one of {STATE_PASSES}, got {state_pass!r}")
    cu_seqlens, _, _ = packed_metadata(cu_seqlens, checkpoint_cu, checkpoint_offsets, q.shape[0])
    num_rows = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        check_float(initial_state, name="initial_state")
        kv = (num_rows, num_v_heads, head_k, head_v)
        expected = kv if state_layout == "kv" else (num_rows, num_v_heads, head_v, head_k)
        if initial_state.shape != expected:
            dims = "[N, HV, K, V]" if state_layout == "kv" else "[N, HV, V, K]"
            raise ValueError(f"initial_state: expected {dims} = {expected} for state_layout={state_layout!r}, "
                             f"got shape {initial_state.shape}")


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _scalar_scores(a, b, g, dot):
    """(a_p b^T)_ij exp(G_i - G_j) for j <= i, one decay for all channels.

    a [P, ..., C, K] stacks P left operands sharing b [..., C, K] and the log decays g [..., C, 1]; returns
    [P, ..., C, C].
    """
    return dot("p...ik,...jk->p...ij", a, b) * jnp.exp(pair_log_decays(g))[..., 0]


def _channel_scores(a, b, g, dot):
    """sum_c a_pic b_jc exp(G_ic - G_jc) for j <= i, per-channel decays (shapes as `_scalar_scores`, g [..., C, K]).

    Rows are split into blocks of SUB_BLOCK with reference row r = the block's first row: for j in earlier blocks,
    exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), both factors <= 1, so the block row is one matmul of
    a exp(G - G_r) against b exp(G_r - G) (masked to j < r before exp). The diagonal blocks use exact pairwise decays.
    Every log-decay difference is summed over its own token range (`log_decay`), never subtracted.
    """
    *lead, size, head_k = b.shape
    block = SUB_BLOCK if size % SUB_BLOCK == 0 else size
    nb = size // block
    pos = jnp.arange(size)
    # G_i - G_r: the block-local cumsum with each block's reference row left out
    g_blocks = jnp.where((pos % block == 0)[:, None], 0, g).reshape(*lead, nb, block, head_k)
    from_ref = jnp.cumsum(g_blocks, axis=-2).reshape(*lead, size, head_k)  # [..., C, K]
    a_dec = a * jnp.exp(from_ref)  # [P, ..., C, K]
    # G_r - G_j for j < r: the sum over (j, r], one suffix sum per reference row
    refs = jnp.arange(nb) * block
    up_to_ref = pos[None, :] <= refs[:, None]  # [nb, C]
    to_ref = suffix_log_decays(jnp.where(up_to_ref[:, :, None], g[..., None, :, :], 0))  # [..., nb, C, K]
    earlier = (pos[None, :] < refs[:, None])[:, :, None]  # [nb, C, 1]
    b_dec = b[..., None, :, :] * jnp.exp(jnp.where(earlier, to_ref, -jnp.inf))  # [..., nb, C, K]
    a_blk = a.reshape(a.shape[0], *lead, nb, block, head_k)
    a_dec_blk = a_dec.reshape(a.shape[0], *lead, nb, block, head_k)
    b_blk, g_blk = (x.reshape(*lead, nb, block, head_k) for x in (b, g))
    off = dot("p...nik,...njk->p...nij", a_dec_blk, b_dec)  # [P, ..., nb, blk, C]
    b_pair = b_blk[..., None, :, :] * jnp.exp(pair_log_decays(g_blk))  # [..., nb, blk, blk, K]
    diag = jnp.sum(a_blk[..., :, None, :] * b_pair, axis=-1)  # [P, ..., nb, blk, blk]
    on_diag = jnp.eye(nb, dtype=bool)[:, None, :, None]  # [nb, 1, nb, 1]
    full = jnp.where(on_diag, diag[..., :, :, None, :], off.reshape(*off.shape[:-3], nb, block, nb, block))
    return full.reshape(*full.shape[:-4], size, size)


def chunked_delta_rule(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
                       checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", chunk_size=64,
                       checkpoint_method="in_chunk", state_pass="associative"):
    """The gated delta rule over packed varlen rows, chunk-parallel, with checkpoint states.

    q, k                # [T, H, K]
    v                   # [T, HV, V]
    g                   # [T, HV, 1] (one decay for all key channels, GDN) or [T, HV, K] (KDA): log decay <= 0
    beta                # [T, HV]
    initial_state       # [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk"); None = zeros
    cu_seqlens          # i32[N + 1]; None = one row over all T tokens
    checkpoint_cu       # i32[N + 1] with checkpoint_offsets i32[M]; both None = no checkpoints
    Inputs are checked by the op wrappers (`check_static`); metadata values are trusted (validated by the caller).

    checkpoint_method "in_chunk" keeps the chunk grid and reads each checkpoint out of its chunk with one masked
    product (outputs and final states bitwise independent of the checkpoints); "forced_break" starts a chunk at every
    checkpoint, whose state is then the state entering that chunk. `state_pass` "associative" carries the state across
    chunks with a parallel prefix scan over the chunk affine maps, "sequential" with one `lax.scan` step per chunk.

    Returns (o [T, HV, V] in v.dtype, final_state fp32 [N, HV, K, V] / [N, HV, V, K],
    checkpoint_states fp32 [M, HV, K, V] / [M, HV, V, K]); padding tokens and padded checkpoint entries give zeros.
    """
    num_tokens, num_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    out_dtype = v.dtype
    f32 = jnp.float32
    dot, state_dot = matmul_policy(q.dtype, k.dtype, v.dtype)
    if scale is None:
        scale = head_k ** -0.5
    if cu_seqlens is None:
        cu_seqlens = jnp.array([0, num_tokens], jnp.int32)
    num_rows = cu_seqlens.shape[0] - 1
    if checkpoint_cu is None:
        checkpoint_cu = jnp.zeros(num_rows + 1, jnp.int32)
        checkpoint_offsets = jnp.zeros(0, jnp.int32)
    if initial_state is None:
        init = jnp.zeros((num_rows, num_v_heads, head_k, head_v), f32)
    else:
        init = initial_state.astype(f32)
        if state_layout == "vk":
            init = init.swapaxes(-1, -2)

    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    group = num_v_heads // num_heads
    q = jnp.repeat(q, group, axis=1) * scale  # [T, HV, K]
    k = jnp.repeat(k, group, axis=1)  # [T, HV, K]
    if num_tokens == 0:
        # a gather needs a source row; one padding token past cu_seqlens[-1] = 0 changes nothing
        q, k, v, g, beta = (jnp.zeros((1, *x.shape[1:]), f32) for x in (q, k, v, g, beta))

    lay = chunk_layout(cu_seqlens, checkpoint_cu, checkpoint_offsets, chunk_size=chunk_size,
                       num_tokens=q.shape[0], forced_breaks=checkpoint_method == "forced_break", xp=jnp)
    pos = jnp.arange(chunk_size)
    in_chunk = pos[None, :] < lay.chunk_len[:, None]  # bool[NC, C]
    token = jnp.where(in_chunk, lay.chunk_start[:, None] + pos[None, :], 0)  # i32[NC, C]

    def to_chunks(x):
        # padding positions get zeros: k = v = beta = g = 0 makes them no-ops of the recurrence
        x = jnp.where(in_chunk.reshape(*in_chunk.shape, *(1,) * (x.ndim - 1)), x[token], 0)  # [NC, C, HV, ...]
        return jnp.moveaxis(x, 2, 1)  # [NC, HV, C, ...]

    q_c, k_c, v_c, g_c = (to_chunks(x) for x in (q, k, v, g))  # [NC, HV, C, K|V|Kg]
    beta_c = to_chunks(beta)[..., None]  # [NC, HV, C, 1]
    G = jnp.cumsum(g_c, axis=2)  # [NC, HV, C, Kg] chunk-local inclusive cumulative log decay
    G_last = G[:, :, -1:, :]  # [NC, HV, 1, Kg]; padding has g = 0, so this is the last real token's
    scores = _scalar_scores if g.shape[-1] == 1 else _channel_scores

    # k and q share the right operand and the decays: one call gives A's scores and the output's A_qk
    A_kk, A_qk = scores(jnp.stack([k_c, q_c]), k_c, g_c, dot)  # [NC, HV, C, C] each, lower incl. diagonal
    A = jnp.where(pos[:, None] > pos[None, :], A_kk, 0) * beta_c  # strictly lower
    rhs = jnp.concatenate([beta_c * jnp.exp(G) * k_c, beta_c * v_c], axis=-1)  # [NC, HV, C, K + V]
    wu = solve_triangular(A, rhs, lower=True, unit_diagonal=True)
    W, U = wu[..., :head_k], wu[..., head_k:]  # [NC, HV, C, K], [NC, HV, C, V]
    k_dec = k_c * jnp.exp(suffix_log_decays(g_c))  # [NC, HV, C, K] decayed to the chunk's end
    decay_last = jnp.exp(G_last).swapaxes(-1, -2)  # [NC, HV, Kg, 1]
    first = lay.chunk_first[:, None, None, None]
    init_c = init[lay.chunk_row]  # [NC, HV, K, V]

    if state_pass == "sequential":
        def step(S, xs):
            W, U, k_dec, decay_last, first, row = xs
            S = jnp.where(first, init[row], S)  # [HV, K, V]
            S = decay_last * S + state_dot("hck,hcv->hkv", k_dec, U - dot("hck,hkv->hcv", W, S))
            return S, S

        S0 = jnp.zeros((num_v_heads, head_k, head_v), f32)
        _, S_after = jax.lax.scan(step, S0, (W, U, k_dec, decay_last, lay.chunk_first, lay.chunk_row))
    else:
        # chunk c maps S to decay_last S + k_dec^T (U - W S); a row's first chunk reads its initial state instead:
        # the scan cuts there and the initial state goes into its offset
        init_first = jnp.where(first, init_c, 0)  # [NC, HV, K, V]
        eye = jnp.eye(head_k, dtype=f32)
        maps = eye * decay_last - dot("nhck,nhcj->nhkj", k_dec, W)  # [NC, HV, K, K]
        offsets = decay_last * init_first + state_dot("nhck,nhcv->nhkv", k_dec,
                                                      U - dot("nhck,nhkv->nhcv", W, init_first))
        # [NC, HV, K, V] the state after each chunk
        S_after = affine_scan(maps, offsets, lay.chunk_first,
                              apply=functools.partial(state_dot, "nhij,nhjv->nhiv"))
    S_prev = jnp.concatenate([jnp.zeros_like(S_after[:1]), S_after[:-1]], axis=0)
    S_enter = jnp.where(first, init_c, S_prev)  # [NC, HV, K, V]
    v_new = U - dot("nhck,nhkv->nhcv", W, S_enter)  # [NC, HV, C, V]

    o_c = dot("nhck,nhkv->nhcv", q_c * jnp.exp(G), S_enter) + dot("nhij,nhjv->nhiv", A_qk, v_new)
    o = jnp.moveaxis(o_c, 1, 2)[lay.token_chunk, lay.token_pos]  # [T, HV, V]
    o = jnp.where(lay.token_valid[:, None, None], o, 0)[:num_tokens].astype(out_dtype)

    last = jnp.maximum(lay.row_first_chunk + lay.row_num_chunks - 1, 0)
    final_state = jnp.where((lay.row_num_chunks > 0)[:, None, None, None], S_after[last], init)  # [N, HV, K, V]

    # state after the first r tokens of chunk c: exp(G_{r-1}) S_c + sum_{i<r} exp(G_{r-1} - G_i) k_i v_new_i^T;
    # r = 0 gives exactly S_c (1 * S_c + 0), which is every forced-break checkpoint
    c, r = lay.checkpoint_chunk, lay.checkpoint_pos
    G_m = G[c]  # [M, HV, C, Kg]
    G_r = jnp.where((r > 0)[:, None, None], jnp.take_along_axis(
        G_m, jnp.maximum(r - 1, 0)[:, None, None, None], axis=2)[:, :, 0], 0)  # [M, HV, Kg]
    before = (pos[None, :] < r[:, None])[:, None, :, None]  # [M, 1, C, 1]
    to_r = suffix_log_decays(jnp.where(before, g_c[c], 0))  # [M, HV, C, Kg] G_{r-1} - G_i, summed over (i, r - 1]
    k_m = k_c[c] * jnp.exp(jnp.where(before, to_r, -jnp.inf))  # [M, HV, C, K]
    checkpoint_states = jnp.exp(G_r)[..., None] * S_enter[c] + state_dot("mhck,mhcv->mhkv", k_m, v_new[c])
    checkpoint_states = jnp.where(lay.checkpoint_valid[:, None, None, None], checkpoint_states, 0)

    if state_layout == "vk":
        final_state, checkpoint_states = final_state.swapaxes(-1, -2), checkpoint_states.swapaxes(-1, -2)
    return o, final_state, checkpoint_states
