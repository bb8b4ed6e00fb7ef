"""The sequential state pass of the chunked gated delta rule over *lanes* (the Mosaic GPU state pass, `state="v2"`).

A lane is a contiguous range of chunks walked in order from a given start state: a whole row (the plain pass,
`state_pass_v2`) or a piece of a row (the sequence split, `split`). Written against jax 0.11.2
(`plgpu.kernel`, Lane lowering semantics, warp specialization by `num_threads` / `thread_name`); check this module
when jax moves.

Why three warpgroups: the first state pass (one warpgroup per CTA, since removed: `bench/README.md`) had a chain
from one chunk's S to the next through SMEM twice (S split to SMEM, wgmma W S, wait, v_new split to SMEM, wgmma
KD^T v_new, wait), with the output products in the same commit group, and measured slower per 64-token chunk on
the H200 than this pass (bench/README.md, kernel-level runs).

Design, per grid point (lane, value head, column block j of BV = 64 columns of S), one CTA of three warpgroups:
- The state is carried *transposed*, S^T [BV, K] fp32 in registers (WGMMA layout), so that both state-feeding
  products take their left operand from registers and the chain never touches SMEM:
      v_new^T = U^T - S^T W^T          (A = S^T registers, B = the transposed view of the w tile [C, K])
      S^T    <- S^T d + v_new^T KD      (A = v_new^T registers, B = the kd tile [C, K]; KDA: d per key = per column)
  Precision (`pipeline` docstring, with the measurement): S^T and v_new^T feed these products as
  16-bit hi + lo pairs (x_hi = x rounded, x_lo = the rounding error rounded), two register-A wgmmas each, fp32
  accumulators. `state_terms=1` drops the lo halves: one wgmma per product, S and v_new rounded to 16 bits where
  they meet W and KD, as FLA's and jla's kernels do (shorter chain, states at their error class, not below it).
- Warp specialization (`num_threads=3`): warpgroup 2 (memory, registers lowered by `set_max_registers`) keeps a
  2- to 4-slot TMA ring of the chunk tiles (w, u[:, cols], kd, qg, aqk, the decays) full; warpgroup 0 (state) runs
  the chain above; warpgroup 1 (output) forms O = QG S_hi + AQK v_new_hi from S^T_hi and v_new^T_hi tiles the state
  warpgroup publishes into double-buffered SMEM (B operands: the transposed view of S^T_hi, v_new_hi stored
  through a transposed view), stages O and TMA-stores it straight into the token layout o [T, HV, V] ("O" below).
  The state warpgroup publishes S^T_hi while the v_new wgmma runs and v_new^T_hi while the update wgmma runs, and
  waits for the output warpgroup only before reusing a published buffer two chunks later. A ring slot is refilled
  once both consumers have released it (`in_free`, two arrivals). All three warpgroups meet at a final barrier: a
  warpgroup exiting while another still issues wgmmas has faulted on sm_90 with jax 0.11.2.
- Checkpoints: a chunk with ck_count[c] > 0 forms, for each of its checkpoints at chunk position r,
  exp(G_{r-1}) S + sum_{i<r} exp(G_{r-1} - G_i) k_i v_new_i^T (r = 0: S itself): kr = k exp(G_{r-1} - G) with
  rows i >= r masked to 0 before use (a select: NaN in padding stays out), kr split into hi + lo SMEM tiles,
  and kr^T v_new = v_new_hi kr_hi + v_new_lo kr_hi + v_new_hi kr_lo (transposed, register A). This runs in the state
  warpgroup between the v_new and the update wgmmas (the fewest live registers): placing it in the output
  warpgroup would need S in fp32 (or its lo half) and v_new_lo published too, and at K = 128 the 2-slot ring
  (129 KB), the published tiles, the kr tiles and O staging already take 217 of the 227 KB of SMEM. A chunk
  without checkpoints pays two branches on a flag loaded one chunk ahead (ck_count[c + 1], a global load that has
  the chunk's wgmmas to land in). The chunk's keys come by TMA from a copy [max(M, 1), C, H, K] gathered in the
  wrapper at each checkpoint chunk's first CSR entry (rows past the chunk zero), issued at the chunk's start so it
  lands during the v_new wgmmas: every TMA copy starts at a whole (8, 64) tile of its GMEM array
  (`pipeline` docstring, "TMA addresses"; a copy from k [T', H, K] at a chunk start off the 8-row
  grid drops rows on the GPU). GDN reads G from the ring's G row, KDA from Checkpoints.G in global memory. The
  carried S never depends on checkpoints.
- O: the output warpgroup stores each chunk's rows at the chunk's own tokens (chunk_start[c] ..), so no XLA gather
  from a chunk-major copy follows (the first state pass wrote one, and on the H200 that gather took a measurable
  share of the call, larger on a varlen mix: bench/README.md, "Variants measured and not taken"). Chunk starts
  follow the rows, off the 8-row grid, where
  a TMA from an (8, 64)-tiled SMEM tile drops rows on the GPU ("TMA addresses" in `pipeline`), so
  the staging tile is `tiles.token_staging`: WGMMA-layout registers go in through its tiled view and a whole chunk
  leaves through its untiled 128-byte-swizzled view (the same bytes for 64 16-bit columns) as one [C, 64] box. A
  TMA store cannot be masked and the rows of a row's last, partial chunk past its length belong to the next row or
  to padding, so such a chunk goes in through the tile's plain view and leaves as boxes of 32, 16, ..., 1 rows
  (`tiles.store_rows`). The CTAs of one extra, empty lane (added by `state_lanes`, once per call) write zeros over
  the tokens past the last lane's last chunk (the padding of a packed call). Under `interpret` (whose RefUnion
  views do not alias) whole chunks leave through the tiled view, which the interpreter copies at any row. All these
  boxes lie inside [0, T), so no token array needs extra rows.
- States cross global memory transposed ([.., V, K]) because Mosaic GPU cannot load or store a WGMMA-layout array
  through a transposed view of a global ref (jax 0.11.2: "Tiled strides must be a multiple of the vector length");
  `state_layout="kv"` (the contract) costs one XLA transpose of lane_init and of the returned states, "vk" none.
- map_mode: the same recurrence over the column blocks of [I | 0] with U -> [0 | U] (blocks j < K / 64 start from
  the identity's columns and take u = 0, the rest read u's block j - K / 64 and start from 0); no output warpgroup
  (`num_threads=2`), no qg / aqk / o, no checkpoints.

SMEM at K = V = 128, bf16 (`_stages`): ring slots of 64.5 KB, published S^T_hi (16 KB) and v_new_hi (8 KB) tiles per
publish slot, one O staging tile of 8 KB (three views of the same bytes; its TMA stores have read it long before the
next chunk's O is ready), checkpoint kr tiles 2 x 16 KB (only with checkpoints), within the 227 KB. With
`publish_slots=1` (the default; the state warpgroup waits for the output warpgroup's previous chunk before
publishing) the ring takes 3 slots without checkpoints (226 KB) and 2 with them; with 2 publish slots, 2 slots (185 /
217 KB). K = 64 and map_mode take 4 slots; `stages` forces a depth. A 2-slot ring leaves one chunk period to hide a
load's latency. Measured on the H200 (bench/README.md, kernel-level runs,
`bench/results/mosaic_gpu_state_h200.log`): a chunk step is markedly shorter than the first pass's, and
`publish_slots=1` was faster in most cases and within a few percent in the rest, hence the default. Each waiter
observes every phase of its barriers before the CTA ends (the `drain` loops): the interpreter checks it when a
barrier is deallocated.

Interpret mode: Mosaic GPU's interpreter (jax 0.11.2) reads a wgmma's A operand only from SMEM, so under
`interpret` every register operand takes a detour through a scratch tile (`tiles.lhs`); the lowering (checked by
`jax.export` for sm_90) uses registers. Its wgmma is an fp32 matmul of the 16-bit tiles, exact for the hi + lo
products: the interpreter checks the algorithm, not the tensor-core rounding.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxckpt.ops.common import pallas_mosaic_gpu_tiles as tiles
from jaxckpt.ops.common.checkpoint_chunks import checkpoint_ranges
from jaxckpt.ops.delta_rule import cumsum

CHUNK = 64
BLOCK_V = 64
_F32 = jnp.float32
_WG = plgpu.Layout.WGMMA
_ROW = _WG.reduce(1)  # one value per row of a WGMMA-layout tile
_COL = _WG.reduce(0)  # one value per column
_STATE, _OUTPUT = 0, 1  # warpgroup ids; the memory warpgroup is the last one


class Checkpoints(NamedTuple):
    """What the state pass needs to export checkpoint states from inside the chunks that hold them."""

    ck_start: object         # i32[NC] per chunk, the CSR range [ck_start, ck_start + ck_count) of its checkpoints
    ck_count: object         # i32[NC]
    checkpoint_pos: object   # i32[M] position r in [0, C) inside its chunk: the state after the chunk's first r tokens
    k: object                # [T', H, K] 16-bit keys (`Prepared.k`)
    chunk_start: object      # i32[NC] packed index of each chunk's first token
    chunk_len: object        # i32[NC]
    G: object                # fp32 [HV, NC, C] (GDN) or [HV, NC, C, K] (KDA): chunk-local cumulative log decay
    l2norm: bool = False     # k is raw: the gathered keys are L2-normalized (`Prepared.qk_l2norm`)


def _stages(head_k, dtype, *, map_mode, has_checkpoints, publish_slots, stages=None):
    """`stages`, or the deepest TMA ring (2 to 4 slots) that fits next to the fixed tiles."""
    size = jnp.dtype(dtype).itemsize
    columns = (2 * head_k + BLOCK_V) if map_mode else (3 * head_k + BLOCK_V + CHUNK)  # of the slot's tiles
    per_stage = CHUNK * columns * size + 4 * max(head_k, CHUNK)
    fixed = 0
    if not map_mode:  # published tiles, O staging
        fixed = (publish_slots * (BLOCK_V * head_k + CHUNK * BLOCK_V) + CHUNK * BLOCK_V) * size
    fixed += 2 * CHUNK * head_k * size if has_checkpoints else 0
    fixed += 1024  # barriers and alignment
    return tiles.ring_depth(per_stage, fixed, stages=stages, what=f"at K = {head_k}")


def _lanes_kernel(*refs, chunk, group, channel, stages, publish_slots, map_mode, has_init, has_checkpoints, terms,
                  interpret, pad_lane, **scratch):
    refs = list(refs)
    take = lambda count: [refs.pop(0) for _ in range(count)]  # noqa: E731
    first_ref, count_ref, dec_ref, w_ref, u_ref, kd_ref = take(6)
    qg_ref, aqk_ref, start_ref, len_ref, pad_ref = (None,) * 5 if map_mode else take(5)
    init_ref = refs.pop(0) if has_init else None
    if has_checkpoints:
        ck_start_ref, ck_count_ref, ck_pos_ref, keys_ref = take(4)
        G_ref = refs.pop(0) if channel else None
    o_ref = None if map_mode else refs.pop(0)
    end_ref = refs.pop(0)
    ckpt_ref = None if map_mode else refs.pop(0)
    s = scratch
    w_s, u_s, kd_s, dec_s, in_bar, in_free, done = (s["w_s"], s["u_s"], s["kd_s"], s["dec_s"], s["in_bar"],
                                                    s["in_free"], s["done"])

    lane, h, j = lax.axis_index("l"), lax.axis_index("h"), lax.axis_index("j")
    wg = lax.axis_index("wg")
    hk = lax.div(h, group)
    head_k = w_s.shape[-1]
    dtype = w_s.dtype
    first, count = first_ref[lane], count_ref[lane]
    num_chunks = w_ref.shape[1]
    state_shape = (BLOCK_V, head_k)  # S^T block
    if map_mode:
        key_blocks = head_k // BLOCK_V
        identity = j < key_blocks  # a column block of [I | 0]: u = 0, start = the identity's columns
        u_cols = pl.ds(jnp.maximum(j - key_blocks, 0) * BLOCK_V, BLOCK_V)
    else:
        u_cols = pl.ds(j * BLOCK_V, BLOCK_V)
    cols = pl.ds(j * BLOCK_V, BLOCK_V)
    memory_wg = 1 if map_mode else 2

    @pl.when(wg == memory_wg)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def issue(c, slot):
            bar = in_bar.at[slot]
            plgpu.copy_gmem_to_smem(w_ref.at[h, c], w_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(u_ref.at[h, c, :, u_cols], u_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(kd_ref.at[h, c], kd_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(dec_ref.at[h, c], dec_s.at[slot], bar)
            if not map_mode:
                plgpu.copy_gmem_to_smem(qg_ref.at[h, c], s["qg_s"].at[slot], bar)
                plgpu.copy_gmem_to_smem(aqk_ref.at[h, c], s["aqk_s"].at[slot], bar)

        tiles.fill_ring(first, count, stages, in_free, issue)

    @pl.when(wg == _STATE)
    def _state():
        plgpu.set_max_registers(232, action="increase")
        if map_mode:
            rows = plgpu.broadcasted_iota(jnp.int32, state_shape, 0, layout=_WG)
            keys = plgpu.broadcasted_iota(jnp.int32, state_shape, 1, layout=_WG)
            S0 = jnp.where(identity & (keys == rows + j * BLOCK_V), 1.0, 0.0).astype(_F32)
        elif has_init:
            S0 = tiles.load(init_ref.at[tiles.lane_state(lane, pad_lane), h, cols])
        else:
            S0 = plgpu.layout_cast(jnp.zeros(state_shape, _F32), _WG)
        detour = lambda name: s.get(name)  # noqa: E731  (interpret only)

        def checkpoints(c, slot, S, vn_hi, vn_lo):
            """The checkpoints of chunk c (module docstring); its keys are landing in kr_hi."""
            kr_hi, kr_lo = s["kr_hi"], s["kr_lo"]
            plgpu.barrier_wait(s["k_bar"])
            k_c = tiles.load(kr_hi)  # [C, K] 16-bit (half the registers of fp32); kr_hi is rewritten below
            tile = (chunk, head_k)
            a_hi, a_lo = tiles.lhs(vn_hi, detour("vn_hi_d")), tiles.lhs(vn_lo, detour("vn_lo_d"))

            def one(m, carry):
                r = ck_pos_ref[m]
                at = jnp.maximum(r - 1, 0)
                inside = jnp.where(r > 0, 1.0, 0.0)  # r = 0: no rows below, decay exp(0): S itself
                before = plgpu.broadcasted_iota(jnp.int32, tile, 0, layout=_WG) < r
                if channel:
                    G_c = tiles.load(G_ref.at[h, c])  # [C, K]
                    G_r = tiles.load(G_ref.at[h, c, at], _COL)  # [K]
                    decay = tiles.by_col(jnp.exp(G_r * inside), state_shape)
                    G_r = tiles.by_col(G_r, tile)
                else:
                    G_c = tiles.by_row(tiles.load(dec_s.at[slot], _ROW), tile)
                    G_r = dec_s[slot, at]
                    decay = jnp.exp(G_r * inside)
                kr = jnp.where(before, k_c.astype(_F32) * jnp.exp(jnp.where(before, G_r - G_c, -jnp.inf)), 0.0)
                hi, lo = tiles.split(kr, dtype, 2)
                kr_hi[...] = hi
                kr_lo[...] = lo
                plgpu.commit_smem()
                added = tiles.matmul(state_shape, ((a_hi, kr_hi), (a_lo, kr_hi), (a_hi, kr_lo)))
                ckpt_ref.at[m, h, cols][...] = decay * S + added
                return carry

            start = ck_start_ref[c]
            lax.fori_loop(start, start + ck_count_ref[c], one, 0)

        def has_checkpoint(c):
            return ck_count_ref[jnp.minimum(c, num_chunks - 1)] > 0

        def step(i, carry):
            S, has_ck = carry
            c, slot, half = first + i, lax.rem(i, stages), lax.rem(i, publish_slots)
            if has_checkpoints:
                # the flag of chunk i + 1, a global load, has this chunk's wgmmas to land in
                has_ck_next = has_checkpoint(c + 1)

                @pl.when(has_ck)
                def _():
                    plgpu.commit_smem()  # the last checkpoint chunk's kr_hi writes, before the async proxy's
                    plgpu.copy_gmem_to_smem(keys_ref.at[ck_start_ref[c], :, hk], s["kr_hi"], s["k_bar"])

            plgpu.barrier_wait(in_bar.at[slot])
            s_hi, s_lo = tiles.split(S, dtype, 2)
            w_t = w_s.at[slot].T  # [K, C]
            u_t = tiles.load(u_s.at[slot].T).astype(_F32)  # [BV, C]
            if map_mode:
                u_t = jnp.where(identity, jnp.zeros_like(u_t), u_t)
            if channel:
                # G_last per key: the columns of S^T
                decay = tiles.by_col(jnp.exp(tiles.load(dec_s.at[slot], _COL)), state_shape)
            else:
                decay = jnp.exp(dec_s[slot, chunk - 1])  # padded rows have g = 0: the last real token's G

            def publish_state():
                @pl.when(i >= publish_slots)
                def _():
                    plgpu.barrier_wait(s["s_free"].at[half])  # the output warpgroup read the slot's last tiles

                s["s_pub"].at[half][...] = s_hi

            pairs = ((tiles.lhs(s_hi, detour("s_hi_d")), w_t), (tiles.lhs(s_lo, detour("s_lo_d")), w_t))[:terms]
            v_new = u_t - tiles.matmul((BLOCK_V, chunk), pairs, None if map_mode else publish_state)  # v_new^T [BV, C]
            vn_hi, vn_lo = tiles.split(v_new, dtype, 2)

            def publish_values():
                s["vn_pub"].at[half].T[...] = vn_hi  # [C, BV]
                plgpu.commit_smem()
                plgpu.barrier_arrive(s["s_ready"].at[half])

            if has_checkpoints:
                # before the update: its accumulator and S_next would otherwise be live through the checkpoints
                @pl.when(has_ck)
                def _():
                    checkpoints(c, slot, S, vn_hi, vn_lo)

            pairs = ((tiles.lhs(vn_hi, detour("vn_hi_d")), kd_s.at[slot]),
                     (tiles.lhs(vn_lo, detour("vn_lo_d")), kd_s.at[slot]))[:terms]
            S_next = decay * S + tiles.matmul(state_shape, pairs, None if map_mode else publish_values)
            plgpu.barrier_arrive(in_free.at[slot])
            return S_next, has_ck_next if has_checkpoints else has_ck

        S, _ = lax.fori_loop(0, count, step, (S0, has_checkpoint(first) if has_checkpoints else False))

        @tiles.real_lanes(lane, pad_lane)
        def _():
            end_ref.at[lane, h, cols][...] = S

        if not map_mode:
            def drain(i, carry):
                plgpu.barrier_wait(s["s_free"].at[lax.rem(i, publish_slots)])
                return carry

            lax.fori_loop(jnp.maximum(count - publish_slots, 0), count, drain, 0)

    if not map_mode:
        @pl.when(wg == _OUTPUT)
        def _output():
            plgpu.set_max_registers(232, action="increase")
            s_pub, vn_pub = s["s_pub"], s["vn_pub"]
            o_land, o_tiled, o_rows = s["o_s"]  # one SMEM tile, three views (module docstring, "O")
            o_full = o_tiled if interpret else o_land  # the interpreter keeps the views apart and copies any rows

            def chunk_output(i, length):
                slot, half = lax.rem(i, stages), lax.rem(i, publish_slots)
                plgpu.barrier_wait(in_bar.at[slot])
                plgpu.barrier_wait(s["s_ready"].at[half])
                o = tiles.matmul((chunk, BLOCK_V), ((s["qg_s"].at[slot], s_pub.at[half].T),
                                               (s["aqk_s"].at[slot], vn_pub.at[half])))
                plgpu.barrier_arrive(s["s_free"].at[half])
                plgpu.barrier_arrive(in_free.at[slot])
                return o.astype(dtype)

            tiles.token_output(chunk_output, first=first, count=count, chunk_start=start_ref, chunk_len=len_ref,
                               tiled=o_tiled, whole=o_full, rows_s=o_rows, dst=o_ref.at[:, h, cols], pad=pad_ref,
                               pad_lane=lane == pad_lane)

    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)


def _checkpoint_keys(checkpoints, num_ckpt, chunk):
    """[max(M, 1), C, H, K]: at each checkpoint chunk's first CSR entry ck_start[c] the chunk's key rows, rows past
    its tokens zero (module docstring: a TMA load must start at a whole (8, 64) tile), normalized with
    `checkpoints.l2norm`; other entries unread."""
    num_chunks = checkpoints.ck_start.shape[0]
    slots = max(num_ckpt, 1)
    target = jnp.where(checkpoints.ck_count > 0, checkpoints.ck_start, slots)
    owner = jnp.zeros(slots, jnp.int32).at[target].set(jnp.arange(num_chunks, dtype=jnp.int32), mode="drop")
    pos = jnp.arange(chunk, dtype=jnp.int32)
    rows = checkpoints.chunk_start[owner][:, None] + pos  # [M, C]
    inside = pos < checkpoints.chunk_len[owner][:, None]
    k = checkpoints.k
    keys = k[jnp.clip(rows, 0, k.shape[0] - 1)]
    keys = cumsum.l2norm(keys) if checkpoints.l2norm else keys
    return jnp.where(inside[:, :, None, None], keys, jnp.zeros((), keys.dtype))  # a select: NaN padding stays out


def state_lanes(lane_first, lane_count, chunk_start, chunk_len, decays, w, u, kd, qg, aqk, lane_init, checkpoints=None,
                *, per_channel_decay, group, num_tokens=None, map_mode=False, interpret=False, state_layout="kv",
                stages=None, publish_slots=1, state_terms=2):
    """The state pass over L lanes.

    lane_first, lane_count  # i32[L]: lane l walks chunks lane_first[l], ..., lane_first[l] + lane_count[l] - 1
                            # (count 0: the lane's end state is its start state; lanes never share a chunk)
    chunk_start, chunk_len  # i32[NC]: chunk c holds the packed tokens [chunk_start[c], + chunk_len[c]) (`ChunkLayout`)
    decays                  # fp32 GDN: [HV, NC, C] (the chunk-local cumulative G rows); KDA: [HV, NC, K] (G_last)
    w, kd, qg               # [HV, NC, C, K] 16-bit (`delta_rule.pallas_triton.intra_v2` / the Mosaic GPU intra kernels)
    u                       # [HV, NC, C, V]
    aqk                     # [HV, NC, C, C]
    lane_init               # fp32 [L, HV, K, V] start states, or None (zeros)
    checkpoints             # `Checkpoints` or None
    Per chunk c of a lane, with S fp32 [K, V] (KDA: d = exp(G_last) scales the rows of S):
        v_new = U_c - W_c S;   O_c = QG_c S + AQK_c v_new;   S <- d S + KD_c^T v_new

    Returns (o [num_tokens, HV, V] in the 16-bit dtype, token t of chunk c at row chunk_start[c] + (t's position),
    tokens from the end of the last lane's last chunk on zero, tokens of chunks outside every lane unspecified;
    lane_end fp32 [L, HV, K, V], checkpoint_states fp32 [max(M, 1), HV, K, V] (entries of chunks outside every lane
    unspecified)).

    map_mode=True (qg, aqk, lane_init and checkpoints None; chunk_start, chunk_len and num_tokens unused): the lane's
    affine map S_end = M S_start + E, returned as
    fp32 [L, HV, K, K + V] = [M | E]: M = prod over the lane's chunks of (D_c - KD_c^T W_c) (later chunks on the
    left; D_c = d I), E the lane's end state from zero. Computed as the same recurrence over the columns of
    [I | 0] with U replaced by [0 | U].

    state_layout="vk": lane_init and every returned state transposed ([.., V, K], map_mode [L, HV, K + V, K]), the
    kernel's own layout: no transposes around it. `stages` (None: the deepest of 4, 3, 2 that fits in SMEM) and
    `publish_slots` (1 or 2) tune the kernel (module docstring). `state_terms`: 2 (default) feeds the two products on
    the state chain (W S and KD^T v_new) as 16-bit hi + lo pairs, 1 as one 16-bit term each (FLA's and jla's
    precision: one wgmma per product instead of two; module docstring). `interpret`: False (GPU), True (Mosaic GPU's
    interpreter) or a `plgpu.InterpretGPUParams` for it.
    """
    if state_layout not in ("kv", "vk"):
        raise ValueError(f"state_layout: must be 'kv' or 'vk', got {state_layout!r}")
    if map_mode and (qg is not None or aqk is not None or lane_init is not None or checkpoints is not None):
        raise ValueError("map_mode: qg, aqk, lane_init and checkpoints must be None")
    if not map_mode and (chunk_start is None or chunk_len is None or num_tokens is None):
        raise ValueError("chunk_start, chunk_len, num_tokens: required for the outputs (map_mode=False)")
    channel, chunk = per_channel_decay, CHUNK
    num_v_heads, num_chunks, chunk_in, head_k = w.shape
    head_v = u.shape[-1]
    if chunk_in != chunk or head_k % BLOCK_V or head_v % BLOCK_V:
        raise ValueError(f"w, u: expected {chunk}-row chunks and K, V multiples of {BLOCK_V}, got {w.shape}, {u.shape}")
    dtype = w.dtype
    num_lanes = lane_first.shape[0]
    width = head_k + head_v if map_mode else head_v  # the columns of the carried state
    has_checkpoints = checkpoints is not None and checkpoints.checkpoint_pos.shape[0] > 0
    num_ckpt = checkpoints.checkpoint_pos.shape[0] if checkpoints is not None else 0
    has_init = lane_init is not None and not map_mode
    if state_terms not in (1, 2):
        raise ValueError(f"state_terms: must be 1 or 2, got {state_terms!r}")
    if publish_slots not in (1, 2):
        raise ValueError(f"publish_slots: must be 1 or 2, got {publish_slots!r}")
    stages = _stages(head_k, dtype, map_mode=map_mode, has_checkpoints=has_checkpoints, publish_slots=publish_slots,
                     stages=stages)

    lane_first, lane_count = lane_first.astype(jnp.int32), lane_count.astype(jnp.int32)
    extra = []
    if not map_mode:
        chunk_start, chunk_len = chunk_start.astype(jnp.int32), chunk_len.astype(jnp.int32)
        lane_first, lane_count, pad = tiles.padding_lane(lane_first, lane_count, chunk_start, chunk_len, num_tokens)
        extra = [chunk_start, chunk_len, pad]
    grid_lanes = lane_first.shape[0]
    inputs = [lane_first, lane_count, decays.astype(_F32), w, u, kd]
    inputs += [] if map_mode else [qg, aqk, *extra]
    if has_init:
        init = lane_init.astype(_F32)
        inputs.append(init if state_layout == "vk" else init.swapaxes(-1, -2))  # [L, HV, V, K]
    if has_checkpoints:
        inputs += [checkpoints.ck_start.astype(jnp.int32), checkpoints.ck_count.astype(jnp.int32),
                   checkpoints.checkpoint_pos.astype(jnp.int32), _checkpoint_keys(checkpoints, num_ckpt, chunk)]
        inputs += [checkpoints.G.astype(_F32)] if channel else []

    end_type = jax.ShapeDtypeStruct((num_lanes, num_v_heads, width, head_k), _F32)
    out_type = [end_type]
    if not map_mode:
        out_type = [jax.ShapeDtypeStruct((num_tokens, num_v_heads, head_v), dtype), end_type,
                    jax.ShapeDtypeStruct((max(num_ckpt, 1), num_v_heads, head_v, head_k), _F32)]
    consumers = 1 if map_mode else 2
    scratch = dict(
        w_s=tiles.swizzled((stages, chunk, head_k), dtype), u_s=tiles.swizzled((stages, chunk, BLOCK_V), dtype),
        kd_s=tiles.swizzled((stages, chunk, head_k), dtype), dec_s=plgpu.SMEM((stages, decays.shape[-1]), _F32),
        in_bar=plgpu.Barrier(num_arrivals=4 if map_mode else 6, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),
        done=plgpu.Barrier(num_arrivals=consumers + 1))
    if not map_mode:
        scratch.update(
            qg_s=tiles.swizzled((stages, chunk, head_k), dtype), aqk_s=tiles.swizzled((stages, chunk, chunk), dtype),
            s_pub=tiles.swizzled((publish_slots, BLOCK_V, head_k), dtype),
            vn_pub=tiles.swizzled((publish_slots, chunk, BLOCK_V), dtype),
            o_s=tiles.token_staging((chunk, BLOCK_V), dtype),
            s_ready=plgpu.Barrier(num_barriers=publish_slots), s_free=plgpu.Barrier(num_barriers=publish_slots))
    if has_checkpoints:
        scratch.update(kr_hi=tiles.swizzled((chunk, head_k), dtype), kr_lo=tiles.swizzled((chunk, head_k), dtype),
                       k_bar=plgpu.Barrier())
    if interpret:
        scratch.update(s_hi_d=tiles.swizzled((BLOCK_V, head_k), dtype), s_lo_d=tiles.swizzled((BLOCK_V, head_k), dtype),
                       vn_hi_d=tiles.swizzled((BLOCK_V, chunk), dtype), vn_lo_d=tiles.swizzled((BLOCK_V, chunk), dtype))

    body = functools.partial(_lanes_kernel, chunk=chunk, group=group, channel=channel, stages=stages,
                             publish_slots=publish_slots, map_mode=map_mode, has_init=has_init,
                             has_checkpoints=has_checkpoints, terms=state_terms, interpret=bool(interpret),
                             pad_lane=None if map_mode else grid_lanes - 1)
    kernel = plgpu.kernel(
        body, out_type=tuple(out_type), scratch_types=scratch, grid=(grid_lanes, num_v_heads, width // BLOCK_V),
        grid_names=("l", "h", "j"), num_threads=consumers + 1, thread_name="wg",
        # Lane semantics: SMEM tiles keep exactly the transforms given above (wgmma and TMA need them)
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret or None,
        kernel_name="delta_state_lanes_map" if map_mode else "delta_state_lanes")
    outs = kernel(*inputs)
    kv = (lambda x: x) if state_layout == "vk" else (lambda x: x.swapaxes(-1, -2))
    if map_mode:
        return kv(outs[0])
    o, lane_end, checkpoint_states = outs
    return o, kv(lane_end), kv(checkpoint_states)


def state_pass_v2(p, w, u, kd, qg, aqk, init, *, per_channel_decay, interpret=False, stages=None, publish_slots=1,
                  state_terms=2):
    """The plain state pass over `delta_rule.cumsum.prepare`'s `p` and the intra pass's intermediates, on
    `state_lanes`, one lane per row; `stages`, `publish_slots`, `state_terms` tune `state_lanes`.

    w, kd, qg   # [HV, NC, C, K] 16-bit
    u           # [HV, NC, C, V]
    aqk         # [HV, NC, C, C]
    init        # fp32 [N, HV, K, V] or None (zeros)
    Returns (o [T', HV, V] in token order, padding tokens zero, final fp32 [N, HV, K, V], checkpoints fp32
    [max(M, 1), HV, K, V], padded entries unspecified)."""
    lay, chunk = p.lay, CHUNK
    num_chunks = w.shape[1]
    checkpoints = None
    if lay.checkpoint_pos.shape[0]:
        ck_start, ck_count = checkpoint_ranges(lay, num_chunks)
        checkpoints = Checkpoints(ck_start, ck_count, lay.checkpoint_pos, p.k, lay.chunk_start, lay.chunk_len, p.G,
                                  p.qk_l2norm)
    decays = p.G[:, :, chunk - 1, :] if per_channel_decay else p.G  # KDA: G_last [HV, NC, K]; GDN: G rows
    return state_lanes(lay.row_first_chunk, lay.row_num_chunks, lay.chunk_start, lay.chunk_len, decays, w, u, kd, qg,
                       aqk, init, checkpoints, per_channel_decay=per_channel_decay, group=w.shape[0] // p.q.shape[1],
                       num_tokens=p.q.shape[0], interpret=interpret, stages=stages, publish_slots=publish_slots,
                       state_terms=state_terms)
