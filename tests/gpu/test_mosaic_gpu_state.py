"""Version 2 of the Mosaic GPU state pass (`pallas_mosaic_gpu_state`) at real sizes on an H100/H200 (K = V = 128,
16 value heads, 8192 tokens, bf16): `state_lanes` on random tiles against the float64 contract (lanes with start
states, a one-chunk lane, an empty lane, chunks outside every lane holding NaN, checkpoints at r = 0, C - 1 and
inside chunks) and in map_mode; `state_pass_v2` against version 1 and float64 on the Triton pipeline's
intermediates (rows starting off the 8-row TMA grid). This is where the register-A wgmmas, the warp-specialized
barriers and the tensor-core rounding run; the CPU interpreter routes register operands through SMEM.

Run on the GPU machine:
`JAXCKPT_GPU_TESTS=1 JAX_PLATFORMS=cuda python -m pytest -q -s tests/gpu/test_mosaic_gpu_state.py`.
"""

import numpy as np
import pytest

from tests.gpu.mosaic_cases import CU_SEQLENS, NUM_TOKENS, delta_inputs

pytestmark = pytest.mark.gpu

C = 64
NC = NUM_TOKENS // C  # 128
HV, GROUP, D = 16, 2, 128
STATE_TOL = 1e-4   # rel-RMS: hi + lo state products on the tensor cores (the interpreter's exact products: 2e-5)
O_TOL = 6e-3
AGREE_TOL = {"o": 2e-3, "final": 1e-4, "checkpoints": 1e-4}
# the pipeline case on `mosaic_cases.CU_SEQLENS` (NC * C tokens): ascending checkpoints per row (row 0: at 1, a chunk
# boundary, inside, len - 1; row 2: a chunk boundary, inside, len - 1), one padded entry
CHECKPOINT_CU = np.array([0, 4, 4, 7], np.int32)
CHECKPOINT_OFFSETS = np.array([1, 640, 1000, 2999, 64, 2047, 5188, 0], np.int32)


def real_case():
    """Chunks of 64 tokens packed from 0 (the last one 40 tokens); lanes [0, 60), [60, 61), empty, [70, 128); chunks
    61-69 outside every lane; checkpoints: r = 0 and C - 1 in chunk 0, 5 in chunk 60, 32 and 33 in chunk 100, 40 in
    the partial chunk 127, one padded entry."""
    chunk_len = np.full(NC, C, np.int32)
    chunk_len[-1] = 40
    ck_pos = np.array([0, C - 1, 5, 32, 33, 40, 0], np.int32)
    ck_count = np.zeros(NC, np.int32)
    ck_count[[0, 60, 100, 127]] = [2, 1, 2, 1]
    ck_start = (np.cumsum(ck_count) - ck_count).astype(np.int32)
    return dict(chunk_start=np.arange(NC, dtype=np.int32) * C, chunk_len=chunk_len,
                lane_first=np.array([0, 60, 61, 70], np.int32), lane_count=np.array([60, 1, 0, 58], np.int32),
                outside=list(range(61, 70)), ck_start=ck_start, ck_count=ck_count, ck_pos=ck_pos, num_tokens=NC * C)


@pytest.mark.parametrize("channel, tuning", [(False, {}), (True, {}), (False, dict(publish_slots=1)),
                                             (True, dict(publish_slots=1))],
                         ids=["gdn", "kda", "gdn-publish-slots-1", "kda-publish-slots-1"])
def test_lanes_against_float64(channel, tuning):
    import jax

    from tests.ops.test_pallas_mosaic_gpu_state import check_lanes, make_tiles, reference, run_lanes

    assert jax.default_backend() == "gpu"
    seed, case = 20261130 + channel, real_case()
    tiles, decays, lane_init, ck = make_tiles(seed, channel=channel, case=case, num_v_heads=HV, group=GROUP, K=D, V=D)
    actual = run_lanes(tiles, decays, lane_init, ck, channel=channel, group=GROUP, case=case, interpret=False,
                       **tuning)
    # without checkpoints: one publish slot buys a 3-slot ring at K = 128
    plain = run_lanes(tiles, decays, lane_init, None, channel=channel, group=GROUP, case=case, interpret=False,
                      **tuning)
    expected = reference(tiles, decays, lane_init, ck, channel=channel, group=GROUP, lane_first=case["lane_first"],
                         lane_count=case["lane_count"], num_tokens=case["num_tokens"])
    inside = np.isfinite(expected[0])
    np.testing.assert_array_equal(plain[0][inside], actual[0][inside])  # checkpoints leave the carried S alone
    np.testing.assert_array_equal(plain[1], actual[1])
    check_lanes(seed, actual, expected, state_tol=STATE_TOL)
    np.testing.assert_array_equal(actual[1][2], lane_init[2])
    np.testing.assert_array_equal(actual[2][0], lane_init[0])


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
def test_map_mode_against_float64(channel):
    import jax.numpy as jnp

    from jaxckpt.ops.common import pallas_mosaic_gpu_state as mgs
    from tests.ops.test_pallas_mosaic_gpu_state import make_tiles, reference_maps, rel_rms

    seed, case = 20261140 + channel, real_case()
    tiles, decays, _, _ = make_tiles(seed, channel=channel, case=case, num_v_heads=HV, group=GROUP, K=D, V=D)
    args = [jnp.asarray(x) for x in (case["lane_first"], case["lane_count"])] + [None, None]
    args += [jnp.asarray(x) for x in (decays, tiles["w"], tiles["u"], tiles["kd"])]
    maps = np.asarray(mgs.state_lanes(*args, None, None, None, per_channel_decay=channel, group=GROUP,
                                      map_mode=True))
    expected = reference_maps(tiles, decays, channel=channel, first=case["lane_first"], count=case["lane_count"])
    print(f"map_mode {'kda' if channel else 'gdn'}: rel-RMS vs float64 {rel_rms(maps, expected):.2e}")
    assert rel_rms(maps, expected) <= STATE_TOL, (seed, rel_rms(maps, expected))


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
def test_state_pass_v2_against_version_1_and_float64(channel):
    import jax.numpy as jnp

    from jaxckpt.ops.common import pallas_mosaic_gpu_delta as mgd
    from jaxckpt.ops.common import pallas_mosaic_gpu_state as mgs
    from jaxckpt.ops.common import pallas_triton_delta as triton_delta
    from tests.ops.test_pallas_mosaic_gpu_state import reference, rel_rms

    (q, k, v), g, beta, init = delta_inputs("kda" if channel else "gdn", np.random.default_rng(20261150 + channel),
                                            NUM_TOKENS, len(CU_SEQLENS) - 1, heads=HV // GROUP, group=GROUP, dim=D)
    p = triton_delta.prepare(q, k, v, jnp.asarray(g), jnp.asarray(beta), per_channel_decay=channel, scale=None,
                             use_qk_l2norm=False, cu_seqlens=jnp.asarray(CU_SEQLENS, jnp.int32),
                             checkpoint_cu=jnp.asarray(CHECKPOINT_CU),
                             checkpoint_offsets=jnp.asarray(CHECKPOINT_OFFSETS), chunk_size=C, interpret=False)
    tiles = triton_delta.intra_v2(p, per_channel_decay=channel, chunk_size=C, interpret=False)
    init = jnp.asarray(init)
    v1 = mgd.state_pass(p, *tiles, init, per_channel_decay=channel)
    v2 = mgs.state_pass_v2(p, *tiles, init, per_channel_decay=channel)

    lay = p.lay
    valid = np.asarray(lay.token_valid)
    rows = (np.asarray(lay.token_chunk)[valid], np.asarray(lay.token_pos)[valid])
    ck_valid = np.asarray(lay.checkpoint_valid)
    num_chunks = tiles[0].shape[1]
    ck_start, ck_count = (np.asarray(a) for a in triton_delta._checkpoint_ranges(lay, num_chunks))
    G = np.asarray(p.G)
    ck = mgs.Checkpoints(ck_start, ck_count, np.asarray(lay.checkpoint_pos), np.asarray(p.k, np.float32),
                         np.asarray(lay.chunk_start), np.asarray(lay.chunk_len), G)
    names = ("w", "u", "kd", "qg", "aqk")
    expected = reference({n: np.asarray(t, np.float32) for n, t in zip(names, tiles)},
                         G[:, :, C - 1] if channel else G, np.asarray(init), ck, channel=channel, group=GROUP,
                         lane_first=np.asarray(lay.row_first_chunk), lane_count=np.asarray(lay.row_num_chunks),
                         num_tokens=p.q.shape[0])
    # v2 and the reference in token order (v2's padding tokens exactly zero), v1 chunk-major
    o_v2 = np.asarray(jnp.asarray(v2[0], jnp.float32))
    np.testing.assert_array_equal(o_v2[~valid], 0)
    tokens = lambda o: np.asarray(o, np.float64)[valid]  # noqa: E731
    picks = ((tokens, lambda o: np.asarray(o, np.float64)[rows], tokens),
             (lambda s: np.asarray(s, np.float64),) * 3, (lambda c: np.asarray(c, np.float64)[ck_valid],) * 3)
    for name, (pick_a, pick_b, pick_e), a, b, e, tol in zip(("o", "final", "checkpoints"), picks, v2, v1, expected,
                                                             (O_TOL, STATE_TOL, STATE_TOL)):
        a, b, e = pick_a(jnp.asarray(a, jnp.float32)), pick_b(jnp.asarray(b, jnp.float32)), pick_e(e)
        print(f"{'kda' if channel else 'gdn'} {name}: rel-RMS v2 vs float64 {rel_rms(a, e):.2e}, v1 vs float64 "
              f"{rel_rms(b, e):.2e}, v2 vs v1 {rel_rms(a, b):.2e}")
        assert np.isfinite(a).all(), name
        assert rel_rms(a, e) <= tol, (name, rel_rms(a, e))
        assert rel_rms(a, b) <= AGREE_TOL[name], (name, rel_rms(a, b))
