"""The Mosaic GPU state pass (`delta_rule.pallas_mosaic_gpu.state`) at real sizes on an H100/H200 (K = V = 128,
16 value heads, 8192 tokens, bf16): `state_lanes` on random tiles against the float64 contract (lanes with start
states, a one-chunk lane, an empty lane, chunks outside every lane holding NaN, checkpoints at r = 0, C - 1 and
inside chunks) and in map_mode; `state_pass_v2` against float64 on the Triton pipeline's
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

    from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import state as mgs
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
def test_state_pass_v2_against_float64(channel):
    import jax.numpy as jnp

    from jaxckpt.ops.delta_rule import cumsum
    from jaxckpt.ops.delta_rule import pallas_triton as triton_delta
    from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import state as mgs
    from tests.ops.test_pallas_mosaic_gpu_state import pipeline_checkpoints, reference, rel_rms

    (q, k, v), g, beta, init = delta_inputs("kda" if channel else "gdn", np.random.default_rng(20261150 + channel),
                                            NUM_TOKENS, len(CU_SEQLENS) - 1, heads=HV // GROUP, group=GROUP, dim=D)
    p = cumsum.prepare(q, k, v, jnp.asarray(g), jnp.asarray(beta), per_channel_decay=channel, scale=None,
                             use_qk_l2norm=False, cu_seqlens=jnp.asarray(CU_SEQLENS, jnp.int32),
                             checkpoint_cu=jnp.asarray(CHECKPOINT_CU),
                             checkpoint_offsets=jnp.asarray(CHECKPOINT_OFFSETS), chunk_size=C, interpret=False)
    tiles = triton_delta.intra_v2(p, per_channel_decay=channel, chunk_size=C, interpret=False)
    init = jnp.asarray(init)
    o, final, ckpts = (np.asarray(jnp.asarray(x, jnp.float32))
                       for x in mgs.state_pass_v2(p, *tiles, init, per_channel_decay=channel))

    lay = p.lay
    valid = np.asarray(lay.token_valid)
    ck_valid = np.asarray(lay.checkpoint_valid)
    names = ("w", "u", "kd", "qg", "aqk")
    G = np.asarray(p.G)
    expected = reference({n: np.asarray(jnp.asarray(t, jnp.float32)) for n, t in zip(names, tiles)},
                         G[:, :, C - 1] if channel else G, np.asarray(init), pipeline_checkpoints(p),
                         channel=channel, group=GROUP, lane_first=np.asarray(lay.row_first_chunk),
                         lane_count=np.asarray(lay.row_num_chunks), num_tokens=p.q.shape[0])
    np.testing.assert_array_equal(o[~valid], 0)  # token order, padding tokens exactly zero
    for name, a, e, tol in (("o", o[valid], expected[0][valid], O_TOL), ("final", final, expected[1], STATE_TOL),
                            ("checkpoints", ckpts[ck_valid], expected[2][ck_valid], STATE_TOL)):
        print(f"{'kda' if channel else 'gdn'} {name}: rel-RMS vs float64 {rel_rms(a, e):.2e}")
        assert np.isfinite(a).all(), name
        assert rel_rms(a, e) <= tol, (name, rel_rms(a, e))
