"""The Mosaic GPU state pass (`delta_rule.pallas_mosaic_gpu.state.state_lanes`, `state_pass_v2`) under Mosaic GPU's CPU
interpreter, against a float64 numpy implementation of the contract (written from its docstring, independent of the
kernels), on random tiles and on the pipeline's own intermediates; the sm_90 lowering of every variant through
`jax.export`.

Fresh random 16-bit tiles every run (the seed is in every failure message). The interpreter's wgmma multiplies the
16-bit tiles in fp32, exactly, so the hi + lo state products are exact here and the bounds below are set by the
method: the carried state and checkpoints hold ~2^-16 relative (hi + lo halves), O uses the high halves (bf16,
~2^-9) and is rounded to bf16. Register-A wgmmas go through SMEM under the interpreter (module docstring), so the
register operand path itself is only lowered here and run by tests/gpu/test_mosaic_gpu_state.py.

Lanes (`TINY`): two with start states (one of them ending in a partial chunk), one empty, chunks outside every lane
all NaN (they must not leak), key rows past each chunk's tokens NaN (masked by the checkpoint path), checkpoints at
r = 0 and r = C - 1 in one chunk, inside a chunk and at a partial chunk's length. The race detector (one case)
tracks barriers, TMA copies and SMEM loads / stores across the three warpgroups, not wgmma operand reads (no vector
clocks on wgmma in jax 0.11.2).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

# no public accessor in jax 0.11.2 for the race detector's verdict
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxckpt.ops.delta_rule import cumsum
from jaxckpt.ops.delta_rule import pallas_triton as triton_delta
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import state as mgs
from tests.numerics import rel_rms

pytestmark = pytest.mark.interpret

C = 64
STATE_TOL = 2e-5   # rel-RMS of end states and checkpoints (hi + lo products)
O_TOL = 6e-3       # rel-RMS of O (high halves, bf16 output)

# 7 chunks: lane 0 walks chunks 0-1 from a start state, lane 1 walks 3-5 (5 partial: 40 tokens) from a start state,
# lane 2 has none (end = start); chunks 2 and 6 belong to no lane and hold NaN everywhere. Checkpoints: two in chunk
# 0 (r = 0: the start state itself, r = C - 1), one in chunk 4, one in chunk 5 (r = its length), one padded entry
TINY = dict(
    chunk_start=np.array([0, 64, 128, 150, 214, 278, 320], np.int32),  # packed token offsets, off the 8-row grid
    chunk_len=np.array([64, 64, 22, 64, 64, 40, 64], np.int32),
    lane_first=np.array([0, 3, 2], np.int32), lane_count=np.array([2, 3, 0], np.int32), outside=[2, 6],
    ck_start=np.array([0, 2, 2, 2, 2, 3, 4], np.int32), ck_count=np.array([2, 0, 0, 0, 1, 1, 0], np.int32),
    ck_pos=np.array([0, C - 1, 17, 40, 0], np.int32), num_tokens=400)


def make_tiles(seed, *, channel, case=TINY, num_v_heads=2, group=2, K=64, V=64, dtype=ml_dtypes.bfloat16):
    """Random tiles (values of the intra kernels' size), decays, start states, keys; NaN outside the lanes."""
    rng = np.random.default_rng(seed)
    NC = case["chunk_start"].size
    HV = num_v_heads
    tiles = dict(w=0.05 * rng.normal(size=(HV, NC, C, K)), u=rng.normal(size=(HV, NC, C, V)),
                 kd=0.05 * rng.normal(size=(HV, NC, C, K)), qg=0.1 * rng.normal(size=(HV, NC, C, K)),
                 aqk=0.1 * np.tril(rng.normal(size=(HV, NC, C, C))))
    tiles = {name: x.astype(dtype) for name, x in tiles.items()}
    g_shape = (HV, NC, C, K) if channel else (HV, NC, C)
    G = np.cumsum(-rng.exponential(0.02, size=g_shape), axis=2).astype(np.float32)
    k = rng.normal(size=(case["num_tokens"], HV // group, K)).astype(dtype)
    for start, length in zip(case["chunk_start"], case["chunk_len"]):  # key rows past a chunk's tokens: masked
        k[start + length:start + C] = np.nan
    for c in case["outside"]:
        for x in (*tiles.values(), G):
            x[:, c] = np.nan
    lane_init = rng.normal(size=(case["lane_first"].size, HV, K, V)).astype(np.float32)
    decays = G[:, :, C - 1] if channel else G
    ck = mgs.Checkpoints(case["ck_start"], case["ck_count"], case["ck_pos"], k, case["chunk_start"],
                         case["chunk_len"], G)
    return tiles, decays, lane_init, ck


def reference(tiles, decays, lane_init, ck, *, channel, group, lane_first=TINY["lane_first"],
              lane_count=TINY["lane_count"], num_tokens=TINY["num_tokens"]):
    """The contract in float64, chunk by chunk: (o [T, HV, V] in token order, lane_end [L, HV, K, V], checkpoints
    [M, HV, K, V]) with NaN where nothing is specified; o's tokens past the last lane's last chunk are 0."""
    w, u, kd, qg, aqk = (np.asarray(tiles[name], np.float64) for name in ("w", "u", "kd", "qg", "aqk"))
    HV, NC, _, K = w.shape
    V = u.shape[-1]
    o = np.full((num_tokens, HV, V), np.nan)
    ends_at = [ck.chunk_start[f + n - 1] + ck.chunk_len[f + n - 1] for f, n in zip(lane_first, lane_count) if n]
    o[max(ends_at, default=0):] = 0
    ends = np.zeros((len(lane_first), HV, K, V))
    ckpts = np.full((max(ck.checkpoint_pos.size, 1), HV, K, V), np.nan)
    G = np.asarray(ck.G, np.float64)
    keys = np.asarray(ck.k, np.float64)
    for lane, (first, count) in enumerate(zip(lane_first, lane_count)):
        for h in range(HV):
            S = np.zeros((K, V)) if lane_init is None else np.asarray(lane_init[lane, h], np.float64)
            for c in range(first, first + count):
                v_new = u[h, c] - w[h, c] @ S
                start, length = ck.chunk_start[c], ck.chunk_len[c]
                o[start:start + length, h] = (qg[h, c] @ S + aqk[h, c] @ v_new)[:length]
                for m in range(ck.ck_start[c], ck.ck_start[c] + ck.ck_count[c]):
                    r = ck.checkpoint_pos[m]
                    G_r = G[h, c, r - 1] if r > 0 else np.zeros_like(G[h, c, 0])
                    k_c = keys[ck.chunk_start[c]:ck.chunk_start[c] + r, h // group]  # [r, K]
                    scale = np.exp(G_r - G[h, c, :r])  # [r] or [r, K]
                    k_c = k_c * (scale if channel else scale[:, None])
                    decay = np.exp(G_r)[:, None] if channel else np.exp(G_r)
                    ckpts[m, h] = decay * S + k_c.T @ v_new[:r]
                d = np.exp(np.asarray(decays[h, c], np.float64))
                S = (d[:, None] if channel else d[C - 1]) * S + kd[h, c].T @ v_new
            ends[lane, h] = S
    return o, ends, ckpts


def reference_maps(tiles, decays, *, channel, first, count):
    """[L, HV, K, K + V]: M as the product of the chunks' (D_c - KD_c^T W_c), E the end state from zero."""
    w, u, kd = (np.asarray(tiles[name], np.float64) for name in ("w", "u", "kd"))
    HV, _, _, K = w.shape
    out = np.zeros((len(first), HV, K, K + u.shape[-1]))
    for lane, (f, n) in enumerate(zip(first, count)):
        for h in range(HV):
            M, E = np.eye(K), np.zeros((K, u.shape[-1]))
            for c in range(f, f + n):
                d = np.exp(np.asarray(decays[h, c], np.float64))
                D = np.diag(d) if channel else d[C - 1] * np.eye(K)
                M = (D - kd[h, c].T @ w[h, c]) @ M
                E = D @ E + kd[h, c].T @ (u[h, c] - w[h, c] @ E)
            out[lane, h] = np.concatenate([M, E], axis=1)
    return out


def run_lanes(tiles, decays, lane_init, ck, *, channel, group, case=TINY, interpret=True, **options):
    names = ("w", "u", "kd", "qg", "aqk")
    args = [jnp.asarray(x) for x in (case["lane_first"], case["lane_count"], case["chunk_start"], case["chunk_len"],
                                     decays, *(tiles[n] for n in names), lane_init)]
    ck = None if ck is None else mgs.Checkpoints(*(jnp.asarray(x) for x in ck))
    outs = mgs.state_lanes(*args, ck, per_channel_decay=channel, group=group, num_tokens=case["num_tokens"],
                           interpret=interpret, **options)
    return [np.asarray(jnp.asarray(x, jnp.float32)) for x in outs]


def check_lanes(seed, actual, expected, *, state_tol=STATE_TOL):
    o, ends, ckpts = actual
    o_ref, ends_ref, ckpts_ref = expected
    inside = np.isfinite(o_ref) & (o_ref != 0)
    assert np.isfinite(o[inside]).all(), seed
    assert rel_rms(o[inside], o_ref[inside]) <= O_TOL, (seed, rel_rms(o[inside], o_ref[inside]))
    np.testing.assert_array_equal(o[o_ref == 0], 0, err_msg=f"seed {seed}: tokens past the lanes")
    assert np.isfinite(ends).all(), seed
    assert rel_rms(ends, ends_ref) <= state_tol, (seed, rel_rms(ends, ends_ref))
    for m in np.flatnonzero(np.isfinite(ckpts_ref).all(axis=(1, 2, 3))):  # entries of checkpoint chunks
        assert rel_rms(ckpts[m], ckpts_ref[m]) <= state_tol, (seed, m, rel_rms(ckpts[m], ckpts_ref[m]))


@pytest.mark.parametrize("channel, tuning", [(False, {}), (True, {}), (False, dict(stages=2, publish_slots=2))],
                         ids=["gdn", "kda", "gdn-2-stages-1-publish-slot"])
def test_lanes_against_float64(channel, tuning):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    tiles, decays, lane_init, ck = make_tiles(seed, channel=channel)
    actual = run_lanes(tiles, decays, lane_init, ck, channel=channel, group=2, **tuning)
    expected = reference(tiles, decays, lane_init, ck, channel=channel, group=2)
    check_lanes(seed, actual, expected)
    # lane 2 walks nothing; checkpoint 0 (r = 0 in lane 0's first chunk) is lane 0's start state, exactly
    np.testing.assert_array_equal(actual[1][2], lane_init[2])
    np.testing.assert_array_equal(actual[2][0], lane_init[0])


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
def test_map_mode_against_float64(channel):
    # column blocks of [I | 0] (K = 64: one identity block) and of [0 | U] (V = 128: two blocks); lanes as above
    seed = int(np.random.SeedSequence().entropy % 2**31)
    tiles, decays, _, _ = make_tiles(seed, channel=channel, V=128)
    args = [jnp.asarray(x) for x in (TINY["lane_first"], TINY["lane_count"])] + [None, None]
    args += [jnp.asarray(x) for x in (decays, tiles["w"], tiles["u"], tiles["kd"])]
    maps = np.asarray(mgs.state_lanes(*args, None, None, None, per_channel_decay=channel, group=2, map_mode=True,
                                      interpret=True))
    expected = reference_maps(tiles, decays, channel=channel, first=TINY["lane_first"], count=TINY["lane_count"])
    assert maps.shape == expected.shape
    assert rel_rms(maps, expected) <= STATE_TOL, (seed, rel_rms(maps, expected))
    np.testing.assert_array_equal(maps[2], np.concatenate([np.eye(64), np.zeros((64, 128))], 1)[None].repeat(2, 0))


def pipeline_case(seed, channel):
    """`prepare` + `intra_v2` (HLO interpreter) on rows of 0, 1, 36, 0, 83 tokens and 10 padding tokens holding NaN,
    with start states and checkpoints (two in a 36-token chunk; 63, the chunk boundary 64 = position 0, 65, 82)."""
    rng = np.random.default_rng(seed)
    T, H, HV, D = 130, 1, 2, 64
    cu_seqlens = np.array([0, 0, 1, 37, 37, 120], np.int32)
    x = dict(q=rng.normal(size=(T, H, D)), k=rng.normal(size=(T, H, D)), v=rng.normal(size=(T, HV, D)),
             g=-rng.exponential(0.1, size=(T, HV, D) if channel else (T, HV)), beta=rng.uniform(0.05, 0.95, (T, HV)))
    for name in x:
        x[name][cu_seqlens[-1]:] = np.nan
    x = {name: jnp.asarray(a, jnp.bfloat16 if name in "qkv" else jnp.float32) for name, a in x.items()}
    p = cumsum.prepare(x["q"], x["k"], x["v"], x["g"], x["beta"], per_channel_decay=channel, scale=None,
                             use_qk_l2norm=True, cu_seqlens=jnp.asarray(cu_seqlens),
                             checkpoint_cu=jnp.array([0, 0, 0, 2, 2, 6], jnp.int32),
                             checkpoint_offsets=jnp.array([1, 35, 63, 64, 65, 82, 0], jnp.int32), chunk_size=C,
                             interpret=True)
    tiles = triton_delta.intra_v2(p, per_channel_decay=channel, chunk_size=C, interpret=True)
    init = jnp.asarray(rng.normal(size=(5, HV, D, D)), jnp.float32)
    return p, tiles, init


def pipeline_checkpoints(p):
    """`Checkpoints` of p's layout in numpy: per chunk the CSR range of the valid entries it holds (chunk-sorted)."""
    lay = p.lay
    num_chunks = lay.chunk_len.shape[0]
    chunk_of = np.where(np.asarray(lay.checkpoint_valid), np.asarray(lay.checkpoint_chunk), num_chunks)
    lo = np.searchsorted(chunk_of, np.arange(num_chunks), side="left")
    hi = np.searchsorted(chunk_of, np.arange(num_chunks), side="right")
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    return mgs.Checkpoints(lo, hi - lo, np.asarray(lay.checkpoint_pos), f32(p.k), np.asarray(lay.chunk_start),
                           np.asarray(lay.chunk_len), f32(p.G))


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
def test_state_pass_v2_on_the_pipeline_against_float64(channel):
    # the intra pass's own tiles, one lane per row: O in token order with the 10 padding tokens (NaN inputs) exactly
    # zero; the real tokens, final states and real checkpoints against the contract in float64 on the same tiles
    seed = int(np.random.SeedSequence().entropy % 2**31)
    p, tiles, init = pipeline_case(seed, channel)
    o, final, ckpts = (np.asarray(jnp.asarray(x, jnp.float32))
                       for x in mgs.state_pass_v2(p, *tiles, init, per_channel_decay=channel, interpret=True))
    lay = p.lay
    valid = np.asarray(lay.token_valid)
    assert o.shape == (p.q.shape[0], *p.v.shape[1:]), o.shape
    np.testing.assert_array_equal(o[~valid], 0, err_msg=str(seed))
    names = ("w", "u", "kd", "qg", "aqk")
    f32 = {name: np.asarray(jnp.asarray(x, jnp.float32)) for name, x in zip(names, tiles)}
    decays = np.asarray(p.G[:, :, C - 1] if channel else p.G)
    o_ref, final_ref, ckpts_ref = reference(f32, decays, np.asarray(init), pipeline_checkpoints(p), channel=channel,
                                            group=2, lane_first=np.asarray(lay.row_first_chunk),
                                            lane_count=np.asarray(lay.row_num_chunks), num_tokens=p.q.shape[0])
    real = np.asarray(lay.checkpoint_valid)
    for name, a, e, tol in (("o", o[valid], o_ref[valid], O_TOL), ("final", final, final_ref, STATE_TOL),
                            ("checkpoints", ckpts[real], ckpts_ref[real], STATE_TOL)):
        assert a.shape == e.shape and np.isfinite(a).all() and np.isfinite(e).all(), (seed, name)
        assert rel_rms(a, e) <= tol, (seed, name, rel_rms(a, e))


def test_no_races_float16():
    # the race detector on one small case (float16 tiles, no output warpgroup idle: every lane kind, checkpoints)
    seed = int(np.random.SeedSequence().entropy % 2**31)
    tiles, decays, lane_init, ck = make_tiles(seed, channel=False, dtype=np.float16)
    actual = run_lanes(tiles, decays, lane_init, ck, channel=False, group=2,
                       interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not get_races().races_found
    check_lanes(seed, actual, reference(tiles, decays, lane_init, ck, channel=False, group=2))


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("mode, head_k, head_v, publish_slots, stages", [
    ("plain", 128, 128, 2, 2), ("checkpoints", 128, 128, 2, 2), ("map", 128, 128, 2, 4),
    ("plain", 128, 128, 1, 3), ("checkpoints", 128, 128, 1, 2),  # the deeper ring one publish slot buys
    ("plain", 64, 128, 2, 4), ("checkpoints", 64, 128, 2, 4), ("map", 64, 128, 2, 4)])
def test_lowers_for_sm90(monkeypatch, channel, mode, head_k, head_v, publish_slots, stages):
    # the register-A wgmma path (interpreted through SMEM above) and the SMEM budget, lowered for sm_90 on CPU
    from jax import export

    # private: the kernel's SMEM bytes, as Mosaic GPU sizes them for the launch
    from jax.experimental.mosaic.gpu import core as mosaic_core

    sizes = []
    tree_size = mosaic_core._smem_tree_size
    monkeypatch.setattr(mosaic_core, "_smem_tree_size", lambda tree: sizes.append(tree_size(tree)) or sizes[-1])
    arg = jax.ShapeDtypeStruct
    HV, NC, L, M, group, dtype = 4, 20, 3, 5, 2, jnp.bfloat16
    tile = lambda width: arg((HV, NC, C, width), dtype)  # noqa: E731
    lanes = [arg((L,), jnp.int32)] * 2 + [arg((NC,), jnp.int32)] * 2
    lanes += [arg((HV, NC, head_k) if channel else (HV, NC, C), jnp.float32), tile(head_k), tile(head_v), tile(head_k)]
    options = dict(per_channel_decay=channel, group=group, publish_slots=publish_slots)
    if mode == "map":
        fn = lambda *a: mgs.state_lanes(*a, None, None, None, map_mode=True, **options)  # noqa: E731
        args = lanes
    else:
        options["num_tokens"] = NC * C - 5  # token-layout O: a row's last chunk may end mid-chunk
        args = lanes + [tile(head_k), tile(C), arg((L, HV, head_k, head_v), jnp.float32)]
        ck = [arg((NC,), jnp.int32)] * 2 + [arg((M,), jnp.int32), arg((NC * C, HV // group, head_k), dtype)]
        ck += [arg((NC,), jnp.int32)] * 2 + [arg((HV, NC, C, head_k) if channel else (HV, NC, C), jnp.float32)]
        if mode == "checkpoints":
            fn = lambda *a: mgs.state_lanes(*a[:11], mgs.Checkpoints(*a[11:]), **options)  # noqa: E731
            args = args + ck
        else:
            fn = lambda *a: mgs.state_lanes(*a, **options)  # noqa: E731
    module = export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    assert ("delta_state_lanes_map" if mode == "map" else "delta_state_lanes") in module
    assert max(sizes) <= 227 * 1024, max(sizes)
    assert mgs._stages(head_k, dtype, map_mode=mode == "map", has_checkpoints=mode == "checkpoints",
                       publish_slots=publish_slots) == stages


def test_checkpoints_and_layout_leave_outputs_bitwise_unchanged():
    # the carried S never depends on checkpoints; state_layout="vk" only skips the transposes around the kernel
    seed = int(np.random.SeedSequence().entropy % 2**31)
    tiles, decays, lane_init, ck = make_tiles(seed, channel=True)
    with_checkpoints = run_lanes(tiles, decays, lane_init, ck, channel=True, group=2)
    vk = run_lanes(tiles, decays, lane_init.swapaxes(-1, -2), None, channel=True, group=2, state_layout="vk")
    inside = np.isfinite(reference(tiles, decays, lane_init, ck, channel=True, group=2)[0])
    np.testing.assert_array_equal(vk[0][inside], with_checkpoints[0][inside], err_msg=str(seed))
    np.testing.assert_array_equal(vk[1].swapaxes(-1, -2), with_checkpoints[1], err_msg=str(seed))
    assert vk[2].shape == (1, 2, 64, 64)
