"""Sequence-parallel prefill of the gated delta rule (GDN, KDA): long rows cut into pieces that run in parallel,
joined exactly by composing the pieces' affine state maps (issue #7; kernels.md §2.5).

With one or two long prompts, a chunked kernel walks each row's chunks in order with only (rows x value heads x
V blocks) programs busy. Here every long row is cut into pieces (boundaries on the row's chunk grid and on its
checkpoints), and one call of an existing chunked implementation (`base`: the Pallas Triton kernels or the XLA
chunked path, through their public op wrappers) runs all pieces as independent rows:

1. Pass 1, one base call over the "piece rows", with the values widened to [0_K | v] and each piece's initial state
   [I_K | S0] (S0 = the row's initial state for a row's first piece, 0 otherwise). The delta rule acts on the
   columns of the state independently, S_t = D_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, so the first K
   columns carry the identity through the piece's tokens and the last V columns carry S0 and the values:
     final state   [M_p | U_p]   M_p = the piece's transition (a K x K map), U_p = its end state from S0
     output at t   [qt_t | o0_t] qt_t = P_t^T q_t (P_t: the map through token t), o0_t = the output from S0
     checkpoint    [P_r | U_r]   at an offset r inside the piece
2. Compose: the state after piece p is S_p = M_p S_{p-1} + U_p, with M_p replaced by 0 at a row's first piece (its
   start state is already inside U_p); a parallel prefix scan over the pieces (`affine_scan`) or a sequential scan
   gives every piece's true incoming state S_in.
3. Finish without a rerun: o_t = o0_t + S_in^T qt_t (exact: o_t = (P_t S_in + U_t)^T q_t), checkpoints inside a
   piece P_r S_in + U_r, checkpoints on a piece boundary S_in of the next piece directly.

The math, why it is exact, the rounding class and the cost model are in README.md beside this file.

Static shapes: the piece table has a static size (rows + T // piece_len + checkpoints), so cu_seqlens and the CSR
checkpoint arrays may be traced; unused entries are empty pieces (identity maps).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxckpt.ops.common import device
from jaxckpt.ops.common.affine_scan import affine_scan, matmul_policy
from jaxckpt.ops.common.xla_arrays import packed_metadata
from jaxckpt.ops.delta_rule import pallas_triton, xla
from jaxckpt.ops.delta_rule.backend import gate_reason
from jaxckpt.ops.delta_rule.chunk import check_static
from jaxckpt.ops.delta_rule.gate import kda_gate
from jaxckpt.plan.layout import chunk_layout, searchsorted

PIECE_CUTS = ("checkpoints", "snap", "grid")
COMPOSE = ("associative", "sequential")
CORRECTIONS = ("pallas", "xla")
# the SequenceParallelConfig fields this implementation takes itself (the rest are its base config's)
OPTION_KEYS = ("base", "piece_len", "target_programs", "min_piece_len", "piece_cuts", "compose", "correction",
               "interpret")
DEFAULT_TARGET_PROGRAMS = 1024   # programs of the base state pass to aim for (H200: 132 SMs, several per SM)
DEFAULT_MIN_PIECE_LEN = 1024     # shorter pieces cost more in maps (K x K per piece and head) than they save
STATE_BLOCK_V = 64               # V tile of the Pallas state pass: programs = rows x HV x V / 64
_BIG = 2 ** 30
_F32 = jnp.float32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def choose_piece_len(*, num_tokens: int, num_rows: int, num_v_heads: int, head_k: int, head_v: int, chunk_size: int,
                     piece_len=None, target_programs=None, min_piece_len=None) -> tuple[int | None, str | None]:
    """(piece length, None) when splitting rows pays at this static shape, else (None, why the plain kernel runs).

    The plain base kernel's sequential pass runs rows x HV x V/64 programs; when that is at least half of
    `target_programs` the GPU is already busy and pieces only add work. Otherwise the tokens are cut into about
    target_programs / (HV x (K + V)/64) pieces (pass 1 carries K + V state columns), each at least `min_piece_len`
    tokens and a multiple of the chunk size. An explicit `piece_len` skips the heuristic.
    """
    if piece_len is not None:
        length = _cdiv(int(piece_len), chunk_size) * chunk_size
    else:
        target = DEFAULT_TARGET_PROGRAMS if target_programs is None else int(target_programs)
        floor = DEFAULT_MIN_PIECE_LEN if min_piece_len is None else int(min_piece_len)
        plain = num_rows * num_v_heads * _cdiv(head_v, STATE_BLOCK_V)
        if 2 * plain >= target:
            return None, (f"batch: {num_rows} rows x {num_v_heads} value heads already give {plain} state-pass "
                          f"programs (target {target}); the plain kernel runs")
        per_piece = num_v_heads * _cdiv(head_k + head_v, STATE_BLOCK_V)
        pieces = max(2, _cdiv(target, per_piece))
        length = _cdiv(_cdiv(num_tokens, pieces), chunk_size) * chunk_size
        length = max(length, _cdiv(floor, chunk_size) * chunk_size)
    if num_tokens <= length:
        return None, f"tokens: {num_tokens} fit in one piece of {length}; the plain kernel runs"
    return length, None


class PiecePlan(NamedTuple):
    """Pieces of the packed rows (a static count P; unused entries are empty pieces) and where checkpoints land.

    Piece p covers tokens [cu[p], cu[p + 1]) of row `row[p]`; `first[p]` marks a row's first piece (its incoming state
    is the row's initial state). Checkpoint m is either on a piece boundary (`boundary[m]`: its state is the state
    after piece `prev[m]`) or inside piece `piece[m]`, exported by the base kernel as its entry `kernel_index[m]` of
    the piece-relative CSR list (`kernel_cu`, `kernel_offsets`).
    """

    cu: object              # i32[P + 1] cu_seqlens of the piece rows (sorted, ends at cu_seqlens[N])
    row: object             # i32[P]
    first: object           # bool[P]
    row_last: object        # i32[N] last piece of each row (its state after it is the row's final state)
    valid: object           # bool[M] real checkpoint entries
    boundary: object        # bool[M]
    prev: object            # i32[M]
    piece: object           # i32[M]
    kernel_index: object    # i32[M]
    kernel_cu: object       # i32[P + 1] (None when no checkpoint goes to the kernel)
    kernel_offsets: object  # i32[M]     (None likewise)


def num_pieces(num_tokens: int, num_rows: int, num_checkpoints: int, piece_len: int, piece_cuts: str) -> int:
    """Static size of the piece table: one piece per row, one per grid cut, one per checkpoint cut."""
    return num_rows + num_tokens // piece_len + (num_checkpoints if piece_cuts == "checkpoints" else 0)


def plan_pieces(cu_seqlens, checkpoint_cu, checkpoint_offsets, *, num_tokens: int, piece_len: int, chunk_size: int,
                piece_cuts: str = "checkpoints") -> PiecePlan:
    """Cuts rows into pieces (jnp; traced metadata allowed, validated values assumed).

    Grid cuts fall every `piece_len` tokens from the row start (rows of at most `piece_len` tokens stay whole).
    `piece_cuts`: "grid" keeps them there and exports every checkpoint inside its piece; "snap" moves each grid cut
    to the nearest chunk-aligned checkpoint within half a piece (so that checkpoint falls out of the composition,
    and every piece still starts on the row's chunk grid); "checkpoints" (default) snaps and also cuts at every other
    checkpoint, so the base kernel exports none (a cut off the chunk grid restarts the chunk grid there, as
    checkpoint_method="forced_break" does).
    """
    if piece_cuts not in PIECE_CUTS:
        raise ValueError(f"piece_cuts: must be one of {PIECE_CUTS}, got {piece_cuts!r}")
    if piece_len % chunk_size:
        raise ValueError(f"piece_len: must be a multiple of chunk_size={chunk_size}, got {piece_len}")
    i32 = jnp.int32
    cu = jnp.asarray(cu_seqlens).astype(i32)
    ccu = jnp.asarray(checkpoint_cu).astype(i32)
    offsets = jnp.asarray(checkpoint_offsets).astype(i32)
    num_rows, num_ckpt = cu.shape[0] - 1, offsets.shape[0]
    last_row = max(num_rows - 1, 0)
    end = cu[-1]
    length = piece_len

    lengths = cu[1:] - cu[:-1]
    row_cuts = jnp.maximum((lengths + length - 1) // length - 1, 0)  # grid cuts per row
    cuts_cu = jnp.concatenate([jnp.zeros(1, i32), jnp.cumsum(row_cuts).astype(i32)])
    num_grid = num_tokens // length  # >= sum(row_cuts)
    grid_ids = jnp.arange(num_grid, dtype=i32)
    grid_valid = grid_ids < cuts_cu[-1]
    grid_row = jnp.clip(searchsorted(jnp, cuts_cu, grid_ids, side="right").astype(i32) - 1, 0, last_row)
    grid_offset = (grid_ids - cuts_cu[grid_row] + 1) * length

    ckpt_ids = jnp.arange(num_ckpt, dtype=i32)
    ckpt_valid = ckpt_ids < ccu[-1]
    ckpt_row = jnp.clip(searchsorted(jnp, ccu, ckpt_ids, side="right").astype(i32) - 1, 0, last_row)
    ckpt_abs = jnp.where(ckpt_valid, cu[ckpt_row] + offsets, end)

    if piece_cuts != "grid" and num_grid and num_ckpt:
        # each chunk-aligned checkpoint bids for its nearest grid cut j (|offset - j L| <= L / 2); the nearest wins
        j = (offsets + length // 2) // length
        dist = offsets - j * length
        bid = ckpt_valid & (offsets % chunk_size == 0) & (j >= 1) & (j <= row_cuts[ckpt_row])
        key = jnp.abs(dist) * 2 + (dist > 0).astype(i32)
        target = jnp.where(bid, cuts_cu[ckpt_row] + j - 1, num_grid)
        best = jnp.full(num_grid, _BIG, i32).at[target].min(key, mode="drop")
        shift = jnp.where(best % 2 == 1, best // 2, -(best // 2))
        grid_offset = jnp.where(best < _BIG, grid_offset + shift, grid_offset)
    grid_abs = jnp.where(grid_valid, cu[grid_row] + grid_offset, end)

    # boundary entries: row starts first (a stable sort keeps an empty row's start before the next row's), then
    # grid cuts, then checkpoint cuts; unused entries sit at cu[N] after everything real
    pos = [cu[:-1], grid_abs]
    rows = [jnp.arange(num_rows, dtype=i32), jnp.where(grid_valid, grid_row, last_row)]
    if piece_cuts == "checkpoints":
        pos.append(ckpt_abs)
        rows.append(jnp.where(ckpt_valid, ckpt_row, last_row))
    pos, rows = jnp.concatenate(pos), jnp.concatenate(rows)
    total = pos.shape[0]
    order = jnp.argsort(pos, stable=True)
    starts = pos[order]
    slot = jnp.zeros(total, i32).at[order].set(jnp.arange(total, dtype=i32))  # sorted slot of each entry
    first = order < num_rows
    row_first = slot[:num_rows]
    row_last = jnp.concatenate([row_first[1:], jnp.full(1, total, i32)]) - 1
    piece_cu = jnp.concatenate([starts, end[None]])

    if piece_cuts == "checkpoints":
        boundary = ckpt_valid
        prev = jnp.maximum(slot[num_rows + num_grid:] - 1, 0)
        piece = jnp.zeros(num_ckpt, i32)
        kernel_index = jnp.zeros(num_ckpt, i32)
        kernel_cu = kernel_offsets = None
    else:
        piece = jnp.clip(searchsorted(jnp, starts, ckpt_abs, side="right").astype(i32) - 1, 0, total - 1)
        rel = ckpt_abs - starts[piece]
        boundary = ckpt_valid & (rel == 0)
        prev = jnp.maximum(piece - 1, 0)
        inside = ckpt_valid & (rel > 0)
        kernel_index = jnp.cumsum(inside).astype(i32) - 1
        kernel_offsets = jnp.zeros(num_ckpt, i32).at[jnp.where(inside, kernel_index, num_ckpt)].set(rel, mode="drop")
        counts = jnp.zeros(total, i32).at[jnp.where(inside, piece, total)].add(1, mode="drop")
        kernel_cu = jnp.concatenate([jnp.zeros(1, i32), jnp.cumsum(counts).astype(i32)])
        kernel_index = jnp.maximum(kernel_index, 0)
    return PiecePlan(piece_cu, rows[order], first, row_last, ckpt_valid, boundary, prev, piece, kernel_index,
                     kernel_cu, kernel_offsets)


def _correction_kernel(start_ref, len_ref, piece_ref, oaug_ref, s_ref, o_ref, *, chunk, head_k, block_v, fp32):
    """o = o0 + qt S_in for one chunk, value head and V block (qt and o0 read from the widened pass-1 output)."""
    c, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, length, p = start_ref[c], len_ref[c], piece_ref[c]
    rows = jnp.arange(chunk, dtype=jnp.int32)

    def mask(width):
        return jnp.broadcast_to(rows[:, None] < length, (chunk, width))

    @pl.when(length > 0)
    def _():
        qt = plt.load(oaug_ref.at[pl.ds(start, chunk), h, pl.ds(0, head_k)], mask=mask(head_k), other=0)
        o0 = plt.load(oaug_ref.at[pl.ds(start, chunk), h, pl.ds(head_k + j * block_v, block_v)],
                      mask=mask(block_v), other=0)
        S = s_ref[p, h, :, pl.ds(j * block_v, block_v)]
        o = o0.astype(_F32) + jax.lax.dot_general(
            qt.astype(_F32), S, (((1,), (0,)), ((), ())), preferred_element_type=_F32,
            precision=jax.lax.Precision.HIGHEST if fp32 else None)
        plt.store(o_ref.at[pl.ds(start, chunk), h, pl.ds(j * block_v, block_v)], o.astype(o_ref.dtype),
                  mask=mask(block_v))


def _correct_pallas(o_aug, S_in, lay, *, head_k, head_v, out_dtype, chunk, interpret):
    num_tokens, num_v_heads = o_aug.shape[:2]
    num_chunks = lay.chunk_len.shape[0]
    block_v = min(head_v, 64)
    full = pl.BlockSpec()
    return pl.pallas_call(
        functools.partial(_correction_kernel, chunk=chunk, head_k=head_k, block_v=block_v,
                          fp32=jnp.dtype(o_aug.dtype).itemsize >= 4),
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_v_heads, head_v), out_dtype),
        grid=(num_chunks, num_v_heads, head_v // block_v), in_specs=[full] * 5, out_specs=full,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
        name="sequence_parallel_correction",
    )(lay.chunk_start, lay.chunk_len, lay.chunk_row, o_aug, S_in)


def _correct_xla(o_aug, S_in, lay, *, head_k, head_v, out_dtype, chunk, dot):
    pos = jnp.arange(chunk)
    in_chunk = pos[None, :] < lay.chunk_len[:, None]  # [NC, C]
    token = jnp.where(in_chunk, lay.chunk_start[:, None] + pos[None, :], 0)
    qt = jnp.where(in_chunk[:, :, None, None], o_aug[token, :, :head_k], 0).astype(_F32)  # [NC, C, HV, K]
    corr = dot("nhck,nhkv->nhcv", jnp.moveaxis(qt, 2, 1), S_in[lay.chunk_row])  # [NC, HV, C, V]
    corr = jnp.moveaxis(corr, 1, 2)[lay.token_chunk, lay.token_pos]  # [T, HV, V]
    return (o_aug[..., head_k:head_k + head_v].astype(_F32) + corr).astype(out_dtype)


def sequence_parallel_delta(base_fn: Callable, q, k, v, g, beta, *, scale=None, use_qk_l2norm=False,
                            initial_state=None, cu_seqlens=None, checkpoint_cu=None, checkpoint_offsets=None,
                            state_layout="kv", chunk_size=64, piece_len: int, piece_cuts="checkpoints",
                            compose="associative", correction="xla", widen_to_pow2=False, interpret=False,
                            base_options=None):
    """The gated delta rule over pieces of long rows (module docstring), with `base_fn` as the chunked kernel.

    `base_fn(q, k, v, g, beta, *, scale, use_qk_l2norm, initial_state, cu_seqlens, checkpoint_cu,
    checkpoint_offsets, state_layout, chunk_size, **base_options)` is a GDN or KDA implementation returning
    (o, final_state, checkpoint_states) with g already the log decay. Shapes and results as that implementation;
    `widen_to_pow2` pads the widened values K + V to a power of two (Triton tiles), `correction` "pallas" runs the
    output correction as a Pallas Triton kernel (`interpret` on CPU), "xla" as gathers and one batched matmul;
    `base_options` (key, value) pairs go to `base_fn`.
    """
    if compose not in COMPOSE:
        raise ValueError(f"compose: must be one of {COMPOSE}, got {compose!r}")
    if correction not in CORRECTIONS:
        raise ValueError(f"correction: must be one of {CORRECTIONS}, got {correction!r}")
    num_tokens, _, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    dot, state_dot = matmul_policy(q.dtype, k.dtype, v.dtype)
    cu_seqlens, checkpoint_cu, checkpoint_offsets = packed_metadata(cu_seqlens, checkpoint_cu, checkpoint_offsets,
                                                                    num_tokens)
    num_rows = cu_seqlens.shape[0] - 1
    plan = plan_pieces(cu_seqlens, checkpoint_cu, checkpoint_offsets, num_tokens=num_tokens, piece_len=piece_len,
                       chunk_size=chunk_size, piece_cuts=piece_cuts)
    num_p = plan.row.shape[0]

    # pass 1: widened values [0_K | v | 0], initial states [I | S0 (a row's first piece) | 0]
    width = head_k + head_v
    width = next_pow2(width) if widen_to_pow2 else width
    pad = width - head_k - head_v
    v_aug = jnp.concatenate([jnp.zeros((num_tokens, num_v_heads, head_k), v.dtype), v,
                             jnp.zeros((num_tokens, num_v_heads, pad), v.dtype)], axis=-1)
    if initial_state is None:
        init = jnp.zeros((num_rows, num_v_heads, head_k, head_v), _F32)
    else:
        init = initial_state.astype(_F32)
        init = init.swapaxes(-1, -2) if state_layout == "vk" else init
    init_first = jnp.where(plan.first[:, None, None, None], init[plan.row], 0)  # [P, HV, K, V]
    eye = jnp.broadcast_to(jnp.eye(head_k, dtype=_F32), (num_p, num_v_heads, head_k, head_k))
    init_aug = jnp.concatenate([eye, init_first, jnp.zeros((num_p, num_v_heads, head_k, pad), _F32)], axis=-1)
    o_aug, final_aug, ckpt_aug = base_fn(
        q, k, v_aug, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, initial_state=init_aug,
        cu_seqlens=plan.cu, checkpoint_cu=plan.kernel_cu, checkpoint_offsets=plan.kernel_offsets, state_layout="kv",
        chunk_size=chunk_size, **dict(base_options or ()))

    # compose: S_p = M_p S_{p-1} + U_p, cut at a row's first piece (its start state is inside U_p)
    maps = final_aug[..., :head_k]  # [P, HV, K, K]
    ends = final_aug[..., head_k:head_k + head_v]  # [P, HV, K, V]
    apply = functools.partial(state_dot, "nhij,nhjv->nhiv")
    if compose == "associative":
        S_after = affine_scan(maps, ends, plan.first, apply=apply)
    else:
        def step(S, xs):
            m, e, first = xs
            S = jnp.where(first, e, apply(m[None], S[None])[0] + e)
            return S, S

        _, S_after = jax.lax.scan(step, jnp.zeros_like(ends[0]), (maps, ends, plan.first))
    S_prev = jnp.concatenate([jnp.zeros_like(S_after[:1]), S_after[:-1]])
    S_in = jnp.where(plan.first[:, None, None, None], 0.0, S_prev)  # what pass 1 left out of each piece

    # finish: o = o0 + S_in^T qt per token, checkpoints on boundaries from the scan, inside pieces P_r S_in + U_r
    lay = chunk_layout(plan.cu, jnp.zeros(num_p + 1, jnp.int32), jnp.zeros(0, jnp.int32), chunk_size=chunk_size,
                       num_tokens=max(num_tokens, 1), xp=jnp)
    if correction == "pallas":
        o = _correct_pallas(o_aug, S_in, lay, head_k=head_k, head_v=head_v, out_dtype=v.dtype, chunk=chunk_size,
                            interpret=interpret)
    else:
        o = _correct_xla(o_aug, S_in, lay, head_k=head_k, head_v=head_v, out_dtype=v.dtype, chunk=chunk_size,
                         dot=dot)
    o = jnp.where(lay.token_valid[:num_tokens, None, None], o, 0).astype(v.dtype)

    final_state = S_after[plan.row_last]
    checkpoint_states = S_after[plan.prev]
    if plan.kernel_cu is not None and ckpt_aug.shape[0]:
        inner = ckpt_aug[plan.kernel_index]  # [M, HV, K, width]
        inner = apply(inner[..., :head_k], S_in[plan.piece]) + inner[..., head_k:head_k + head_v]
        checkpoint_states = jnp.where(plan.boundary[:, None, None, None], checkpoint_states, inner)
    checkpoint_states = jnp.where(plan.valid[:, None, None, None], checkpoint_states, 0.0)
    if state_layout == "vk":
        final_state, checkpoint_states = final_state.swapaxes(-1, -2), checkpoint_states.swapaxes(-1, -2)
    return o, final_state, checkpoint_states


# ---------------------------------------------------------------------------------------------------------------
# The entry shared by `jaxckpt.ops.delta_rule.sequence_parallel` and `jaxckpt.ops.delta_rule.sequence_parallel`.

BASES = ("pallas_triton", "xla")
XLA_BASE_KEYS = ("state_pass",)


def _is_tile(n: int) -> bool:
    """A power of two a Triton tile can take (16 to 256)."""
    return 16 <= n <= 256 and n & (n - 1) == 0


def _split_options(options):
    own = {key: options[key] for key in OPTION_KEYS if key in options}
    return own, {key: value for key, value in options.items() if key not in OPTION_KEYS}


def _check_own(own) -> str | None:
    if own.get("base") not in (None, *BASES):
        return f"base: must be one of {BASES} or None, got {own['base']!r}"
    for key, allowed in (("piece_cuts", PIECE_CUTS), ("compose", COMPOSE), ("correction", CORRECTIONS)):
        if own.get(key) is not None and own[key] not in allowed:
            return f"{key}: must be one of {allowed}, got {own[key]!r}"
    for key in ("piece_len", "target_programs", "min_piece_len"):
        value = own.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            return f"{key}: must be a positive Python int, got {value!r}"
    return None


def resolve(q, k, v, g, beta, *, chunk_size, options) -> tuple[dict | None, str | None]:
    """The static choices for one call: ({base, base_options, correction, ...}, None) or (None, why not).

    `base` None picks the Pallas Triton kernels when they support the widened call here (K + V value columns,
    padded to a power of two), else the XLA chunked path.
    """
    own, tuning = _split_options(options)
    reason = _check_own(own)
    if reason is not None:
        return None, reason
    interpret = bool(own.get("interpret", False))
    head_k, head_v = q.shape[-1], v.shape[-1]
    base = own.get("base")
    if base in (None, "pallas_triton"):
        wide = jax.ShapeDtypeStruct((*v.shape[:-1], next_pow2(head_k + head_v)), v.dtype)
        reason = pallas_triton.supports(q, k, wide, g, beta, chunk_size=chunk_size, interpret=interpret, **tuning)
        if reason is None:
            base = "pallas_triton"
        elif base == "pallas_triton":
            return None, f"base: 'pallas_triton' declines the widened call (V -> {next_pow2(head_k + head_v)}): " \
                         f"{reason}"
        else:
            base = "xla"
    if base == "xla":
        unknown = sorted(set(tuning) - set(XLA_BASE_KEYS))
        if unknown:
            return None, f"tuning: {unknown} are not options of the xla base (it takes {XLA_BASE_KEYS})"
    pow2_v = _is_tile(head_v)
    correction = own.get("correction") or ("pallas" if base == "pallas_triton" and pow2_v else "xla")
    if correction == "pallas" and not (pow2_v and _is_tile(head_k)):
        return None, f"correction: 'pallas' needs K and V powers of two >= 16, got K={head_k}, V={head_v}"
    if correction == "pallas" and not interpret and not device.is_gpu():
        return None, f"correction: 'pallas' needs a GPU (or interpret=True), got {jax.default_backend()!r}"
    base_options = dict(tuning)
    if base == "pallas_triton":
        base_options["interpret"] = interpret
    return dict(base=base, base_options=base_options, correction=correction, interpret=interpret,
                piece_len=own.get("piece_len"), target_programs=own.get("target_programs"),
                min_piece_len=own.get("min_piece_len"), piece_cuts=own.get("piece_cuts") or "checkpoints",
                compose=own.get("compose") or "associative"), None


def run_delta(bases: dict[str, Callable], q, k, v, g, beta, *, scale, use_qk_l2norm, initial_state, cu_seqlens,
              checkpoint_cu, checkpoint_offsets, state_layout, chunk_size, choice: dict):
    """Plain base call where pieces do not pay (`choose_piece_len`), else `sequence_parallel_delta` on it."""
    base_fn = bases[choice["base"]]
    base_options = tuple(sorted(choice["base_options"].items()))
    num_rows = 1 if cu_seqlens is None else jnp.shape(cu_seqlens)[0] - 1
    length, _ = choose_piece_len(num_tokens=q.shape[0], num_rows=num_rows, num_v_heads=v.shape[1],
                                 head_k=q.shape[-1], head_v=v.shape[-1], chunk_size=chunk_size,
                                 piece_len=choice["piece_len"], target_programs=choice["target_programs"],
                                 min_piece_len=choice["min_piece_len"])
    common = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, initial_state=initial_state, cu_seqlens=cu_seqlens,
                  checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, state_layout=state_layout,
                  chunk_size=chunk_size)
    if length is None:
        return base_fn(q, k, v, g, beta, **common, **dict(base_options))
    return _sequence_parallel_jit(base_fn, q, k, v, g, beta, **common, piece_len=length,
                                  piece_cuts=choice["piece_cuts"], compose=choice["compose"],
                                  correction=choice["correction"], widen_to_pow2=choice["base"] == "pallas_triton",
                                  interpret=choice["interpret"], base_options=base_options)


_sequence_parallel_jit = jax.jit(
    sequence_parallel_delta, static_argnums=0,
    static_argnames=("scale", "use_qk_l2norm", "state_layout", "chunk_size", "piece_len", "piece_cuts", "compose",
                     "correction", "widen_to_pow2", "interpret", "base_options"))


def supports(q, k, v, g, beta, *, chunk_size=64, **options) -> str | None:
    """None when `gated_delta_rule` (g [T, HV]) or `kda` (g [T, HV, K]) can run these inputs and options here, else
    the reason."""
    return gate_reason(q, g) or resolve(q, k, v, g, beta, chunk_size=chunk_size, options=options)[1]


def differentiable(q, k, v, g, beta, *, chunk_size=64, **options) -> bool:
    """Whether JAX differentiates through the call: with the XLA base and the XLA correction (plain jnp/lax), not
    through the Pallas kernels."""
    choice, _ = resolve(q, k, v, g, beta, chunk_size=chunk_size, options=options)
    return choice is not None and choice["base"] == "xla" and choice["correction"] == "xla"


def _run(bases, q, k, v, g, beta, *, per_channel_decay, scale, use_qk_l2norm, initial_state, cu_seqlens, checkpoint_cu,
         checkpoint_offsets, state_layout, chunk_size, options):
    check_static(q, k, v, g, beta, per_channel_decay=per_channel_decay, scale=scale, initial_state=initial_state,
                 cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                 state_layout=state_layout, chunk_size=chunk_size, checkpoint_method="in_chunk")
    choice, reason = resolve(q, k, v, g, beta, chunk_size=chunk_size, options=options)
    if reason is not None:
        raise ValueError(reason)
    return run_delta(bases, q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, initial_state=initial_state,
                     cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                     state_layout=state_layout, chunk_size=chunk_size, choice=choice)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
                     checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", chunk_size=64, **options):
    """Gated delta rule with a scalar log decay per token and value head, sequence-parallel over long rows.

    Arguments, shapes and results as `jaxckpt.ops.delta_rule.xla.gated_delta_rule` (metadata may be traced). Options
    (all static): base ("pallas_triton" | "xla" | None = Pallas where it supports the widened call), piece_len
    (tokens per piece; None = from the shape, `choose_piece_len`, which also falls back to the plain base call where
    pieces do not pay), target_programs, min_piece_len, piece_cuts ("checkpoints" | "snap" | "grid"), compose
    ("associative" | "sequential"), correction ("pallas" | "xla"), interpret (Pallas on CPU); any other option goes
    to the base (Pallas tuning, or the XLA path's state_pass).
    """
    bases = {"pallas_triton": pallas_triton.gated_delta_rule, "xla": xla.gated_delta_rule}
    return _run(bases, q, k, v, g, beta, per_channel_decay=False, scale=scale, use_qk_l2norm=use_qk_l2norm,
                initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                checkpoint_offsets=checkpoint_offsets, state_layout=state_layout, chunk_size=chunk_size,
                options=options)


def kda(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", A_log=None, dt_bias=None, lower_bound=None,
        chunk_size=64, **options):
    """Kimi Delta Attention, sequence-parallel over long rows: the gate (`gate.kda_gate`) once before the pieces.

    Arguments, shapes and results as `jaxckpt.ops.delta_rule.xla.kda` (g is the raw gate with A_log / dt_bias /
    lower_bound); options as `gated_delta_rule`.
    """
    bases = {"pallas_triton": pallas_triton.kda, "xla": xla.kda}
    check_static(q, k, v, g, beta, per_channel_decay=True, scale=scale, initial_state=initial_state,
                 cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                 state_layout=state_layout, chunk_size=chunk_size, checkpoint_method="in_chunk")
    g = kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return _run(bases, q, k, v, g, beta, per_channel_decay=True, scale=scale, use_qk_l2norm=use_qk_l2norm,
                initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                checkpoint_offsets=checkpoint_offsets, state_layout=state_layout, chunk_size=chunk_size,
                options=options)
