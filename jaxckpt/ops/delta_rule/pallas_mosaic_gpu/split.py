"""The sequence split of the Mosaic GPU state pass: each row's chunks cut into P pieces that run in parallel, joined
exactly by the pieces' affine state maps.

The state pass is sequential over a row's chunks, one CTA per (row, value head, V / 64): at (1 row, 16 heads,
V = 128) that is 32 CTAs on a 132-SM H200, so most SMs idle for the whole pass. Here every row is cut into P
contiguous pieces of balanced chunk counts (`split_lanes`: piece p of row n is lane n * P + p) and the lanes kernel
(`state.state_lanes`) runs them side by side, twice:

    per chunk c, with W_c, KD_c [C, K], U_c [C, V], D_c = exp(G_last) (a scalar, or for KDA diag of a K-vector):
        S <- D_c S + KD_c^T (U_c - W_c S) = (D_c - KD_c^T W_c) S + KD_c^T U_c
    so a piece maps its start state affinely: S_end = M S_start + E, with M = prod of (D_c - KD_c^T W_c) over its
    chunks (later chunks on the left) and E its end state from zero (an empty piece: M = I, E = 0).

1. Map pass (map_mode lanes) over pieces 0 .. P-2 of every row: [M | E] fp32 [K, K + V] per piece and value head,
   the same recurrence run over the K + V columns of [I | 0] with U replaced by [0 | U] ((K + V) / 64 column blocks
   per lane). The last piece's map is never needed: its end state is the row's final state, from pass 3.
2. Scan in XLA (fp32, precision HIGHEST), P - 1 dependent steps: start_0 = the row's initial state,
   start_{p+1} = M_p start_p + E_p, on the transposed states the kernel takes and returns (`state_layout="vk"`).
   Without an initial state start_0 = 0, so start_1 = E_0 and the first product is skipped.
3. Main pass (normal lanes) over all N * P lanes from their starts: outputs, checkpoint states (each checkpoint chunk
   lies in exactly one lane, and a checkpoint at the first position of a piece is that piece's start state, as
   `state_lanes` gives r = 0) and lane end states; row n's final state is its last piece's end. O leaves the kernel
   in token order: every lane stores only its own chunks' tokens, and the one extra, empty lane that the kernel
   adds per call (not per piece) zeros the padding tokens past the last row, so no gather follows.

Exact: the recurrence is affine in S, so the scan reproduces the state entering every piece; nothing is
approximated or truncated. Rounding: each start state is the plain pass's state plus the rounding of the map pass
(the same 16-bit hi + lo products as the main pass, over the columns of [I | 0]) and of P - 1 fp32 products, the
same class as the sequential pass. With normalized keys, beta in (0, 1] and decaying gates every token's map
D_t (I - beta_t k_t k_t^T) has norm <= 1, so an error in one start state does not grow along the scan.

Cost model (`choose_pieces`): a lane of L chunks costs about L chunk steps and one CTA holds an SM (the state
kernels' SMEM), so a pass of X CTAs costs ceil(X / SMs) waves of its lane length. With NC chunks per row:
    plain:   N * HV * V/64 CTAs, NC steps
    split:   map pass N * (P-1) * HV * (K+V)/64 CTAs, main pass N * P * HV * V/64 CTAs, each NC / P steps
plus the scan's P - 1 small batched products and one more launch. P = 1 unless the plain pass leaves most SMs idle;
otherwise the power of two up to 8 with the fewest estimated steps (ties to the smaller P), keeping >= 8 chunks
per piece on average so the per-lane start (TMA prologue, initial load) stays small beside the lane's chunks. At
(1, 8192, 16) K = V = 128 on 132 SMs: P = 1 costs 128 steps, P = 2 64 + 64 (one wave each: no gain), P = 4
2 * 32 + 32 = 96, P = 8 4 * 16 + 2 * 16 = 96: P = 4.

The fused GDN pass (`fused_pass_split`, state "fused"): the same plan, scan and passes over
`gdn_fused.gdn_fused_lanes`, which keeps the lanes contract (a lane: contiguous chunks from a start
state; map_mode: [M | E] of the same recurrence over the column blocks of [I | 0] with v -> [0 | v]) on `gdn_kkt`'s
chunk-major q, k, v, T0 and beta, computed once for both passes. `_split` holds the plan and the scan; each kernel
enters through a small lanes runner that speaks the split's transposed "vk" states. The fused kernel takes and
returns [.., K, V] states and [M | E] maps but transposes them to its own [.., V, K] at its boundary, so the
runner's transposes meet the kernel's and XLA folds each pair away. Its map pass has the same CTA count and lane
lengths as the lanes kernel's, so `choose_pieces` serves both.

Shapes are static in (N, P, NC): the lane arrays are traced from the chunk layout, so cu_seqlens may be traced.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax

from jaxckpt.ops.common import device
from jaxckpt.ops.common.checkpoint_chunks import checkpoint_ranges, split_lanes
from jaxckpt.ops.delta_rule import cumsum
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import gdn_fused
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import state as lanes_kernel

MAX_PIECES = 8
MIN_CHUNKS_PER_PIECE = 8
COLUMN_BLOCK = 64  # columns of S per CTA in both passes
CHUNK = 64
_F32 = jnp.float32


def choose_pieces(num_rows, num_v_heads, head_v, num_tokens, *, head_k=None, num_sms=None) -> int:
    """The piece count P for rows of num_tokens / num_rows tokens on average (module docstring, "Cost model").

    Static, from shapes only. `head_k` defaults to head_v; `num_sms` to the GPU's SM count (132 off a GPU).
    """
    num_sms = num_sms or device.num_sms()
    head_k = head_k or head_v
    plain = num_rows * num_v_heads * (head_v // COLUMN_BLOCK)
    if num_rows == 0 or 2 * plain > num_sms:
        return 1
    chunks = num_tokens / num_rows / CHUNK
    waves = lambda ctas: math.ceil(ctas / num_sms)  # noqa: E731
    best, best_steps = 1, chunks
    pieces = 2
    while pieces <= MAX_PIECES and chunks / pieces >= MIN_CHUNKS_PER_PIECE:
        map_ctas = num_rows * (pieces - 1) * num_v_heads * ((head_k + head_v) // COLUMN_BLOCK)
        steps = (waves(map_ctas) + waves(plain * pieces)) * chunks / pieces
        if steps < best_steps:
            best, best_steps = pieces, steps
        pieces *= 2
    return best


def _piece_starts(maps, init):
    """Each piece's start state from the maps of pieces 0 .. P-2 and the rows' initial states, all transposed (the
    lanes kernel's own layout): start_{p+1}^T = start_p^T M_p^T + E_p^T.

    maps    # fp32 [N, P - 1, HV, K + V, K] = [M | E]^T
    init    # fp32 [N, HV, V, K] or None (zeros)
    Returns fp32 [N, P, HV, V, K].
    """
    head_k = maps.shape[-1]
    M_t, E_t = maps[..., :head_k, :], maps[..., head_k:, :]
    if init is None:
        starts = [jnp.zeros_like(E_t[:, 0]), E_t[:, 0]]
    else:
        starts = [init]
    for p in range(len(starts) - 1, maps.shape[1]):
        product = jnp.einsum("nhvj,nhjk->nhvk", starts[-1], M_t[:, p], precision=lax.Precision.HIGHEST)
        starts.append(product + E_t[:, p])
    return jnp.stack(starts, axis=1)


def _split(lay, init, run_lanes, *, pieces):
    """The plan, the map pass, the scan and the main pass (module docstring, steps 1-3) over one lanes kernel.

    run_lanes(lane_first, lane_count, lane_init, *, map_mode): the kernel over those lanes with every state in the
    transposed "vk" layout: lane_init fp32 [L, HV, V, K] or None; map_mode gives [M | E]^T fp32 [L, HV, K + V, K],
    else (o [T', HV, V] in token order, lane ends [L, HV, V, K], checkpoints [max(M, 1), HV, V, K]).
    init    # fp32 [N, HV, K, V] or None (zeros)
    Returns (o, final fp32 [N, HV, K, V], checkpoints fp32 [max(M, 1), HV, K, V]).
    """
    num_rows = lay.row_first_chunk.shape[0]
    lane_first, lane_count = split_lanes(lay.row_first_chunk, lay.row_num_chunks, pieces=pieces)
    lane_init = None if init is None else init.swapaxes(-1, -2)  # [N, HV, V, K]
    if pieces > 1:
        # the last piece of each row needs no map
        leading = lambda x: x.reshape(num_rows, pieces)[:, :-1].reshape(-1)  # noqa: E731
        maps = run_lanes(leading(lane_first), leading(lane_count), None, map_mode=True)
        maps = maps.reshape(num_rows, pieces - 1, *maps.shape[1:])
        lane_init = _piece_starts(maps, lane_init)
        lane_init = lane_init.reshape(num_rows * pieces, *lane_init.shape[2:])
    o, lane_end, checkpoint_states = run_lanes(lane_first, lane_count, lane_init, map_mode=False)
    final = lane_end.reshape(num_rows, pieces, *lane_end.shape[1:])[:, -1]
    return o, final.swapaxes(-1, -2), checkpoint_states.swapaxes(-1, -2)


def state_pass_split(p, w, u, kd, qg, aqk, init, decays, *, per_channel_decay, pieces, interpret=False,
                     state_terms=2):
    """`state.state_pass_v2` (same arguments and results) with each row cut into `pieces` lanes
    (module docstring), both passes on `state.state_lanes`.

    w, kd, qg   # [HV, NC, C, K] 16-bit
    u           # [HV, NC, C, V]
    aqk         # [HV, NC, C, C]
    init        # fp32 [N, HV, K, V] or None (zeros)
    decays      # fp32: GDN G [HV, NC, C]; KDA G's last rows [HV, NC, K] (p.G need hold only checkpoint chunks)
    Returns (o [T', HV, V] in token order (`prepare`'s T' = max(T, 1)), padding tokens zero, final fp32
    [N, HV, K, V], checkpoints fp32 [max(M, 1), HV, K, V], padded entries unspecified).
    """
    lay = p.lay
    num_v_heads, num_chunks, chunk = w.shape[:3]
    # states cross the lanes kernel transposed, its own layout: only the rows' initial and final states and the
    # checkpoints are transposed, not every lane's start and end state nor the maps
    options = dict(per_channel_decay=per_channel_decay, group=num_v_heads // p.q.shape[1], interpret=interpret,
                   state_layout="vk", state_terms=state_terms)
    chunks = (lay.chunk_start, lay.chunk_len)
    checkpoints = None
    if lay.checkpoint_pos.shape[0]:
        ck_start, ck_count = checkpoint_ranges(lay, num_chunks)
        checkpoints = lanes_kernel.Checkpoints(ck_start, ck_count, lay.checkpoint_pos, p.k, lay.chunk_start,
                                               lay.chunk_len, p.G, p.qk_l2norm)

    def run_lanes(lane_first, lane_count, lane_init, *, map_mode):
        if map_mode:
            return lanes_kernel.state_lanes(lane_first, lane_count, *chunks, decays, w, u, kd, None, None, None,
                                            map_mode=True, **options)
        # every lane stores its own chunks' tokens; the kernel's one extra lane zeros the padding tokens
        return lanes_kernel.state_lanes(lane_first, lane_count, *chunks, decays, w, u, kd, qg, aqk, lane_init,
                                        checkpoints, num_tokens=p.q.shape[0], **options)

    return _split(lay, init, run_lanes, pieces=pieces)


def fused_pass_split(p, init, *, pieces, interpret=False, state_terms=2):
    """`gdn_fused.gdn_fused_pass` (same arguments and results) with each row cut into `pieces`
    lanes (module docstring, "The fused GDN pass"): `gdn_kkt` once, then both passes on `gdn_fused_lanes`.

    p     # `delta_rule.cumsum.prepare(..., per_channel_decay=False)`; the caller checks `gdn_fused.supports`
    init  # fp32 [N, HV, K, V] or None (zeros)
    Returns (o [T', HV, V] in token order, padding tokens zero, final fp32 [N, HV, K, V], checkpoints fp32
    [max(M, 1), HV, K, V], padded entries unspecified).
    """
    cumsum.check_qk_normalized(p, reader="fused_pass_split")
    lay = p.lay
    group = p.v.shape[1] // p.q.shape[1]
    t0, q_c, k_c, v_c, beta_c = gdn_fused.gdn_kkt(lay.chunk_start, lay.chunk_len, p.q, p.k, p.v, p.beta, group=group,
                                                  interpret=interpret)
    checkpoints = None
    if lay.checkpoint_pos.shape[0]:
        ck_start, ck_count = checkpoint_ranges(lay, lay.chunk_len.shape[0])
        checkpoints = gdn_fused.Checkpoints(ck_start, ck_count, lay.checkpoint_pos)
    lanes = functools.partial(gdn_fused.gdn_fused_lanes, chunk_start=lay.chunk_start, chunk_len=lay.chunk_len, q=q_c,
                              k=k_c, v=v_c, beta=beta_c, G=p.G, T0=t0, group=group, scale=p.scale,
                              num_tokens=p.q.shape[0], interpret=interpret, state_terms=state_terms)

    def run_lanes(lane_first, lane_count, lane_init, *, map_mode):
        # gdn_fused_lanes speaks [.., K, V] states and [M | E] maps but transposes them to its own [.., V, K] at its
        # boundary, so the transposes here meet the kernel's and XLA folds each pair away
        if map_mode:
            return lanes(lane_first, lane_count, lane_init=None, map_mode=True).swapaxes(-1, -2)
        lane_init = None if lane_init is None else lane_init.swapaxes(-1, -2)
        o, lane_end, checkpoint_states = lanes(lane_first, lane_count, lane_init=lane_init, checkpoints=checkpoints)
        return o, lane_end.swapaxes(-1, -2), checkpoint_states.swapaxes(-1, -2)

    return _split(lay, init, run_lanes, pieces=pieces)
