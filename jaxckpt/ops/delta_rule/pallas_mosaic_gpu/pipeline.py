"""The chunked gated delta rule (GDN scalar decay, KDA per-key-channel decay) on Pallas Mosaic GPU kernels (Hopper:
wgmma + TMA), exporting checkpoint states from inside the state pass: the pipeline (`delta_rule_mosaic`, `supports`).

Written against jax 0.11.2 (`jax.experimental.pallas.mosaic_gpu` as plgpu: `plgpu.kernel`, Lane lowering
semantics); the Mosaic GPU API changes between jax releases, so check this module when jax moves.

`delta_rule_mosaic` has `delta_rule.pallas_triton.delta_rule`'s contract and results. It runs the shared first stage
(`delta_rule.cumsum.prepare`: layout, GDN's gate cumsum), an intra pass writing chunk-major w, u, kd, qg, aqk
[HV, NC, C, *] in the 16-bit input dtype (the Mosaic GPU kernels of `intra` / `kda_intra`, which with `use_qk_l2norm`
normalize q's and k's rows as they load them: an XLA pass before them read and wrote q and k once more), then a state
pass chosen by `state` (defaults: `default_tuning`): "v2", the lanes kernel of `state` (the default), or "fused" (GDN:
`gdn_fused`, which replaces the intra pass and takes q, k normalized by `prepare`). Both fuse the output:

    per row n, value head h, V block j (BV = 64 columns), S = S[:, cols] fp32 [K, BV], for the row's chunks c:
    v_new = U_c - W_c S;   O_c = QG_c S + AQK_c v_new;   S <- exp(G_last) S + KD_c^T v_new
    (KDA: exp(G_last) is a [K] vector scaling the rows of S.)

Both run behind the sequence split (`split`). KDA's intra kernel forms G from the raw gate itself and returns what
the state pass reads of it (each chunk's last row, the rows of checkpoint chunks). Both store O straight into the
token layout [T, HV, V] with the padding tokens zero (an untiled TMA view, `state` docstring, "O").

Precision of the state chain: wgmma takes 16-bit operands, so with `state_terms=2` the fp32 S and v_new feed the
state-feeding products as an unevaluated sum x_hi + x_lo of two 16-bit tiles (x_hi = x rounded, x_lo = the
rounding error rounded): W S = W S_hi + W S_lo and KD^T v_new = KD^T v_new_hi + KD^T v_new_lo, accurate to ~2^-16
relative in bf16 (TF32, what the Triton pass uses for them, keeps 10 mantissa bits; S_hi alone keeps 8, and the
error compounds over the row's chunks). Measured offline (numpy, GDN, K = V = 128, 512 chunks of mild decay, the
same bf16 W, U, KD, fp32 carry), final-state rel-RMS against feeding S and v_new unrounded: TF32 1.8e-4, bf16 S_hi
only 4.6e-4, hi + lo 7e-7. `state_terms=1` (the default) feeds the high halves alone, as FLA and jla do. The output
products use the high halves only (QG S_hi, AQK v_new_hi), as the Triton pass's 16-bit "bulk" dots do.
Accumulation is fp32 throughout; O goes out in the input dtype.

TMA addresses: every TMA copy through a tiled SMEM tile starts at a whole (8, 64) tile of its GMEM array
(chunk-major arrays, from row 0). Mosaic GPU issues a copy between GMEM and an SMEM tile with the (8, 64) tiling as
a TMA over the GMEM array tiled the same way: a row offset o becomes tile o // 8 plus in-tile row o % 8, with a box
8 rows tall in a dimension 8 rows long, so on the GPU o % 8 of every 8 rows fall out of bounds (a store drops them,
a load zero-fills them), while the interpreter copies them all. The first state pass stored O at each chunk's
packed token offset and loaded the checkpoint keys from k [T, H, K] at the chunk start: a row starting at 1501
(o % 8 = 5) kept 3 of every 8 output rows on the H200. So checkpoint keys travel in copies gathered per checkpoint
chunk, and the lanes kernels store O at token offsets through an *untiled* SMEM view, which has no such limit
(`tiles.token_staging`).

Supported (`supports`): chunk 64, K and V in {64, 128}, q, k, v one 16-bit dtype (bf16 or float16), a Hopper GPU
(or interpret mode), launch grids within CUDA's caps (at most 65535 chunks, T // 64 + N, and 65535 lanes, N x
pieces; exact when `supports` gets cu_seqlens). Float32 inputs are declined: wgmma would run them at TF32 (or a
3-way bf16 split of every operand tile), below the float32 class; the Triton and XLA paths serve them.

Interpret mode (`interpret=True`, CPU): the state kernels run in Mosaic GPU's interpreter (`plgpu.InterpretGPUParams`;
its wgmma is an fp32 matmul of the 16-bit SMEM tiles, so the hi + lo products are exact there and the interpreter
checks the algorithm, not the tensor-core rounding), the cumsum and intra kernels in the Pallas HLO interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxckpt.ops.common import device
from jaxckpt.ops.common import pallas_mosaic_gpu_tiles as tiles
from jaxckpt.ops.common.checkpoint_chunks import checkpoint_ranges
from jaxckpt.ops.common.configs import MAX_MOSAIC_PIECES
from jaxckpt.ops.common.contract import kernel_dtype_reason
from jaxckpt.ops.delta_rule import cumsum
from jaxckpt.ops.delta_rule.backend import gate_reason, kernel_entries
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import gdn_fused
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import intra as mosaic_intra
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import kda_intra as mosaic_kda_intra
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import split as mosaic_split
from jaxckpt.plan.layout import max_chunks

CHUNK = 64
STATES = ("v2", "fused")
TUNING_KEYS = ("intra_num_warps", "num_stages", "state", "pieces", "kda_score_parts", "state_terms", "intra_inverse")
# state "fused" forms the intra products itself (`gdn_kkt` and the lanes loop); the cumsum launch keeps its tuning
_NOT_FUSED = ("kda_score_parts", "intra_inverse")
# the Mosaic GPU intra kernels' options as the op names them
_MOSAIC_INTRA_TUNING = {"kda_score_parts": "score_parts", "intra_inverse": "inverse"}
_F32 = jnp.float32


def default_tuning(*, per_channel_decay, state=None):
    """What the options left out mean (measured on the H200, bench/README.md "Latest results"): the lanes state pass
    with the sequence split chosen from the shapes and one 16-bit term per product on the state chain (`state_terms=1`,
    FLA's precision: 17-19% less device time for GDN at one row, states still below FLA's error on the parity problem);
    the Mosaic GPU intra pass (GDN: 2.9x faster than the Triton one; KDA: fp16 score operands, 2.6x faster) for keys of
    any norm (its inverse is scaled by the keys' norms, `intra`, "Range")."""
    state = state or "v2"
    return dict(state=state, pieces="auto", state_terms=1)


def _state_reason(state, pieces, state_terms=2) -> str | None:
    if state not in STATES:
        return f"tuning: state must be one of {STATES}, got {state!r}"
    if state_terms not in (1, 2) or isinstance(state_terms, bool):
        return f"tuning: state_terms must be 1 or 2, got {state_terms!r}"
    if pieces != "auto" and (isinstance(pieces, bool) or not isinstance(pieces, (int, np.integer))
                             or not 1 <= pieces <= MAX_MOSAIC_PIECES):
        return f"tuning: pieces must be an int in [1, {MAX_MOSAIC_PIECES}] or 'auto', got {pieces!r}"
    return None


def _grid_reason(q, v, *, num_rows, num_chunks, state, pieces) -> str | None:
    """None when the state pass's launch grids fit CUDA's caps, else the reason (the intra kernels check theirs at
    launch): the lanes (rows x pieces, `split_lanes`) on the first axis of a three-axis
    grid, launched on grid z; for "fused" also `gdn_kkt`'s (chunk, value head) grid."""
    if pieces == "auto":
        pieces = mosaic_split.choose_pieces(num_rows, v.shape[1], v.shape[2], q.shape[0], head_k=q.shape[2])
    if num_rows * pieces > mosaic_intra.MAX_GRID_YZ:
        return (f"cu_seqlens: {num_rows} rows x {pieces} pieces make {num_rows * pieces} lanes along the state pass's "
                f"grid z axis, more than CUDA's {mosaic_intra.MAX_GRID_YZ}")
    reason = mosaic_intra.grid_reason(num_chunks) if state == "fused" else None
    return None if reason is None else f"state pass (fused): {reason}"


def supports(q, k, v, g, beta, *, chunk_size=64, interpret=False, cu_seqlens=None, **tuning) -> str | None:
    """None when `gated_delta_rule` (g [T, HV]) or `kda` (g [T, HV, K]) can run the call here, else the reason (so
    the caller can fall back to the next implementation). An option given as None means its default, as in
    `delta_rule_mosaic`.

    `cu_seqlens` (i32[N + 1], may be traced: only its static shape is read) sizes the launch grids exactly: the
    chunk layout has T // 64 + N chunks (`prepare`), the state passes N x pieces lanes. Left out, the call is one
    row over all T tokens (as `delta_rule_mosaic` reads cu_seqlens=None); a caller that has rows and leaves them
    out gets one row's grid checks, and a grid past CUDA's caps is then a ValueError of `delta_rule_mosaic` (or of
    the intra kernel) at trace time instead of a reason here.
    """
    reason = gate_reason(q, g)
    if reason is not None:
        return reason
    if cu_seqlens is not None and (np.ndim(cu_seqlens) != 1 or np.shape(cu_seqlens)[0] < 2):
        return f"cu_seqlens: expected i32[N + 1] with N >= 1, got shape {np.shape(cu_seqlens)}"
    tuning = {key: value for key, value in tuning.items() if value is not None}
    unknown = sorted(set(tuning) - set(TUNING_KEYS))
    if unknown:
        return f"tuning: unknown options {unknown}, expected some of {TUNING_KEYS}"
    defaults = default_tuning(per_channel_decay=g.ndim == 3, state=tuning.get("state"))
    reason = _state_reason(tuning.get("state", defaults["state"]), tuning.get("pieces", defaults["pieces"]),
                           tuning.get("state_terms", defaults["state_terms"]))
    if reason is not None:
        return reason
    if tuning.get("state") == "fused":
        if g.ndim == 3:
            return ("tuning: state='fused' is the fused GDN pass (a scalar decay per token); KDA's per-channel decay "
                    "needs state 'v2'")
        given = sorted(set(tuning) & set(_NOT_FUSED))
        if given:
            return f"tuning: {given} tune the intra pass, which state='fused' replaces with its own kernels"
        if chunk_size == CHUNK:
            reason = gdn_fused.supports(q, k, v, beta, interpret=interpret)
            if reason is not None:
                return f"state pass (fused): {reason}"
    if chunk_size != CHUNK:
        return f"chunk_size: the Mosaic GPU state pass runs {CHUNK}-token chunks (wgmma tiles), got {chunk_size!r}"
    if q.ndim != 3 or v.ndim != 3:
        return "q, v: expected [T, H, K] and [T, HV, V]"
    reason = (tiles.wgmma_reason(dict(K=q.shape[-1], V=v.shape[-1]), dict(q=q, k=k, v=v),
                                 fallback=" (float32 inputs: use pallas_triton or xla)")
              or kernel_dtype_reason(dict(g=g, beta=beta)))
    if reason is not None:
        return reason
    num_rows = 1 if cu_seqlens is None else np.shape(cu_seqlens)[0] - 1
    # `prepare`'s chunk layout, static in T and N (an empty call lays out one token)
    num_chunks = max_chunks(max(q.shape[0], 1), num_rows, 0, CHUNK, forced_breaks=False)
    reason = _grid_reason(q, v, num_rows=num_rows, num_chunks=num_chunks, state=tuning.get("state", defaults["state"]),
                          pieces=tuning.get("pieces", defaults["pieces"]))
    if reason is not None:
        return reason
    if tuning.get("state") != "fused":  # "fused": its kkt kernel replaces the intra pass
        if "kda_score_parts" in tuning and g.ndim != 3:
            return "tuning: kda_score_parts tunes the KDA Mosaic GPU intra pass; this is a GDN call"
        mosaic_tuning = {_MOSAIC_INTRA_TUNING[key]: value for key, value in tuning.items()
                         if key in _MOSAIC_INTRA_TUNING}
        if g.ndim == 3:  # the KDA intra kernel takes the raw gate
            reason = mosaic_kda_intra.supports(q, k, v, beta, jax.ShapeDtypeStruct(g.shape, _F32),
                                               num_chunks=num_chunks, chunk=chunk_size, interpret=interpret,
                                               **mosaic_tuning)
        else:
            G = jax.ShapeDtypeStruct((v.shape[1], num_chunks, CHUNK), _F32)
            reason = mosaic_intra.supports(q, k, v, beta, G, chunk=chunk_size, interpret=interpret, **mosaic_tuning)
        if reason is not None:
            return f"intra pass: {reason}"
    if not interpret and not device.is_hopper():
        return "backend: the Mosaic GPU state pass needs a Hopper GPU (sm_90, wgmma) or interpret=True"
    return None


def delta_rule_mosaic(q, k, v, g, beta, *, per_channel_decay, scale=None, use_qk_l2norm=False, initial_state=None,
                      cu_seqlens=None, checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", chunk_size=64,
                      interpret=False, intra_num_warps=4, num_stages=2, state=None, pieces=None,
                      kda_score_parts=None, state_terms=None, intra_inverse=None):
    """`delta_rule.pallas_triton.delta_rule` with the Mosaic GPU state pass (module docstring); same arguments and
    results.

    q, k                # [T, H, K] 16-bit
    v                   # [T, HV, V] same dtype
    g                   # [T, HV] (GDN) or [T, HV, K] (KDA, `per_channel_decay`): log decay <= 0
    beta                # [T, HV]
    initial_state       # [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk"); None = zeros
    cu_seqlens          # i32[N + 1]; None = one row over all T tokens
    checkpoint_cu       # i32[N + 1] with checkpoint_offsets i32[M]; both None = no checkpoints
    The intra pass (`intra.gdn_intra` / `kda_intra.kda_intra`) takes the
    latter's `score_parts` as kda_score_parts (2 feeds the score products as hi + lo pairs) and both kernels'
    `inverse` as intra_inverse ("f16", "split" or "blocked", None their default); intra_num_warps and num_stages tune
    the Triton gate cumsum launch. `interpret`: True runs every kernel on CPU; a `plgpu.InterpretGPUParams` (e.g.
    detect_races=True) does too, with those settings for the Mosaic GPU interpreter. Left out, state and pieces take
    `default_tuning`'s values.
    `state`: the state pass, "v2" (the lanes kernel, `state.state_lanes`, through
    `split.state_pass_split`) or, GDN only,
    "fused" (`gdn_fused`: `gdn_kkt` and then the fused state loop `gdn_fused_lanes`, which forms
    the intra products itself and never writes w, u, kd, qg, aqk; through `split.fused_pass_split`;
    it replaces the intra pass, so the intra options are rejected with it, while intra_num_warps and
    num_stages still tune the cumsum launch); `pieces`: each row cut into that many pieces
    run in parallel and joined exactly by their affine state maps (1: the plain pass over whole rows), or "auto" for
    `split.choose_pieces` (1 unless the plain pass leaves most SMs idle); `state_terms`: 2 feeds
    the state chain's products as 16-bit hi + lo pairs, 1 (default) as one 16-bit term each, FLA's and jla's
    precision, for a shorter chain.

    Returns (o [T, HV, V] in v.dtype, final_state fp32 [N, HV, K, V] / [N, HV, V, K],
    checkpoint_states fp32 [M, HV, K, V] / [M, HV, V, K]); padding tokens and padded checkpoint entries are zeros.
    """
    if state == "fused":
        given = {"kda_score_parts": kda_score_parts, "intra_inverse": intra_inverse}
        given = sorted(name for name, value in given.items() if value is not None)
        if given:
            raise ValueError(f"tuning: {given} tune the intra pass, which state='fused' replaces with its own kernels")
    defaults = default_tuning(per_channel_decay=per_channel_decay, state=state)
    state = defaults["state"]
    pieces = defaults["pieces"] if pieces is None else pieces
    state_terms = defaults["state_terms"] if state_terms is None else state_terms
    reason = _state_reason(state, pieces, state_terms)
    if reason is not None:
        raise ValueError(reason)
    if state == "fused" and per_channel_decay:
        raise ValueError("state: 'fused' is the fused GDN pass (a scalar decay per token), not KDA's")
    num_tokens = q.shape[0]
    triton_interpret = bool(interpret)  # the Triton kernels take the HLO interpreter, whatever the Mosaic GPU one
    p = cumsum.prepare(q, k, v, g, beta, per_channel_decay=per_channel_decay, scale=scale,
                       use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                       checkpoint_offsets=checkpoint_offsets, chunk_size=chunk_size, interpret=triton_interpret,
                       intra_num_warps=intra_num_warps, num_stages=num_stages,
                       launch_cumsum=not per_channel_decay, l2norm_in_kernel=state != "fused")
    init = None
    if initial_state is not None:
        init = initial_state.astype(_F32)
        init = init.swapaxes(-1, -2) if state_layout == "vk" else init
    if pieces == "auto":
        pieces = mosaic_split.choose_pieces(p.cu_seqlens.shape[0] - 1, v.shape[1], v.shape[2], num_tokens,
                                            head_k=q.shape[2])
    # the rows are known here, so the grids are checked exactly even when `supports` was asked without them
    reason = _grid_reason(q, v, num_rows=p.cu_seqlens.shape[0] - 1, num_chunks=p.lay.chunk_len.shape[0], state=state,
                          pieces=pieces)
    if reason is not None:
        raise ValueError(reason)
    lay = p.lay
    if state == "fused":
        o, final_state, checkpoint_states = mosaic_split.fused_pass_split(p, init, pieces=pieces, interpret=interpret,
                                                                          state_terms=state_terms)
    else:
        given = {"kda_score_parts": kda_score_parts, "intra_inverse": intra_inverse}
        mosaic_tuning = {_MOSAIC_INTRA_TUNING[key]: value for key, value in given.items() if value is not None}
        options = dict(chunk=chunk_size, group=p.v.shape[1] // p.q.shape[1], scale=p.scale, l2norm=p.qk_l2norm,
                       interpret=interpret, **mosaic_tuning)
        intra_inputs = (lay.chunk_start, lay.chunk_len, p.q, p.k, p.v, p.beta)
        if per_channel_decay:
            # the KDA intra kernel forms G from the raw gate and returns what the state pass reads of it: every
            # chunk's last row (its decay) and the rows of the chunks that hold checkpoints
            counts = checkpoint_ranges(lay, lay.chunk_len.shape[0])[1] if lay.checkpoint_pos.shape[0] else None
            w, u, kd, qg, aqk, decays, G = mosaic_kda_intra.kda_intra(*intra_inputs, p.g, checkpoint_count=counts,
                                                                       **options)
            p = p._replace(G=G)
        else:
            w, u, kd, qg, aqk = mosaic_intra.gdn_intra(*intra_inputs, p.G, **options)
            decays = p.G
        o, final_state, checkpoint_states = mosaic_split.state_pass_split(
            p, w, u, kd, qg, aqk, init, decays, per_channel_decay=per_channel_decay, pieces=pieces,
            interpret=interpret, state_terms=state_terms)
    o = o[:num_tokens]  # token order, padding tokens zero; T' = 1 for an empty call
    num_ckpt = lay.checkpoint_pos.shape[0]
    checkpoint_states = jnp.where(lay.checkpoint_valid[:, None, None, None], checkpoint_states[:num_ckpt], 0)
    if state_layout == "vk":
        final_state, checkpoint_states = final_state.swapaxes(-1, -2), checkpoint_states.swapaxes(-1, -2)
    return o, final_state, checkpoint_states


gated_delta_rule, kda = kernel_entries(delta_rule_mosaic, supports, TUNING_KEYS,
                                       inputs="q, k, v in one 16-bit dtype, K and V in (64, 128); `chunk_size` 64",
                                       config="jaxckpt.ops.DeltaPallasMosaicGpuConfig")
