"""The fused GDN pass (`delta_rule.pallas_mosaic_gpu.gdn_fused`) on an H100/H200 at real sizes: against float64 and
against the unfused Mosaic GPU pipeline (`gdn_intra` + `delta_rule.pallas_mosaic_gpu.state.state_pass_v2`), whose error
it must not exceed; varlen rows off the 8-row TMA grid with NaN padding; map_mode consistent with the plain lanes. This
is where the tensor-core rounding, the register-A wgmma path and the TMA addressing are checked (the CPU interpreter
sees none of them: tests/ops/test_pallas_mosaic_gpu_gdn_fused.py).

Run on the GPU machine:
`JAXCKPT_GPU_TESTS=1 JAX_PLATFORMS=cuda python -m pytest -q -s tests/gpu/test_mosaic_gpu_gdn_fused.py`.
"""

import numpy as np
import pytest

from tests.numerics import rel_rms

pytestmark = pytest.mark.gpu

BF16_TOL = 6e-3  # tests/vectors/loader.py's "bf16" class (rel-RMS)


def make_case(seed, lengths, offsets, *, heads, group, padding=0, mild=False):
    """bf16 l2-normalized q, k and v, softplus-style log decays (`mild`: divided by 32, so a chunk keeps ~20% of the
    state instead of ~e^-40 and states carry across chunks), sigmoid beta, start states; NaN padding tokens."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    T, HV, D = sum(lengths) + padding, heads * group, 128
    x = dict(q=unit(rng.standard_normal((T, heads, D))), k=unit(rng.standard_normal((T, heads, D))),
             v=rng.standard_normal((T, HV, D)),
             g=-np.log1p(np.exp(-rng.standard_normal((T, HV)))) / (32 if mild else 1),
             beta=1 / (1 + np.exp(-rng.standard_normal((T, HV)))))
    for a in x.values():
        a[sum(lengths):] = np.nan
    x = {name: jnp.asarray(a, jnp.bfloat16 if name in "qkv" else jnp.float32) for name, a in x.items()}
    meta = dict(cu_seqlens=np.cumsum([0, *lengths]).astype(np.int32),
                checkpoint_cu=np.cumsum([0, *map(len, offsets)]).astype(np.int32),
                checkpoint_offsets=np.concatenate(offsets).astype(np.int32))
    init = (0.1 * rng.standard_normal((len(lengths), HV, D, D))).astype(np.float32)
    return x, meta, init


def run(pipeline, x, meta, init, kkt_inverse="f16"):
    """(o of the real tokens, final states, checkpoints) of "fused" (`gdn_fused_pass`, `gdn_kkt` with kkt_inverse) or
    "unfused" (`gdn_intra` + `delta_rule.pallas_mosaic_gpu.state.state_pass_v2`) from `prepare`, on the GPU; o in token
    order, its padding tokens exactly zero."""
    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.delta_rule import cumsum
    from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import gdn_fused as fused
    from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import intra as mgi
    from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import state as mgs

    cu, ck_cu, ck_off = (jnp.asarray(meta[name]) for name in ("cu_seqlens", "checkpoint_cu", "checkpoint_offsets"))

    @jax.jit
    def call(x, init):
        p = cumsum.prepare(x["q"], x["k"], x["v"], x["g"], x["beta"], per_channel_decay=False, scale=None,
                                 use_qk_l2norm=False, cu_seqlens=cu, checkpoint_cu=ck_cu, checkpoint_offsets=ck_off,
                                 chunk_size=64, interpret=False)
        lay = p.lay
        if pipeline == "fused":
            o, final, ckpts = fused.gdn_fused_pass(p, init, kkt_inverse=kkt_inverse)
        else:
            tiles = mgi.gdn_intra(lay.chunk_start, lay.chunk_len, p.q, p.k, p.v, p.beta, p.G, chunk=64,
                                  group=p.v.shape[1] // p.q.shape[1], scale=p.scale)
            o, final, ckpts = mgs.state_pass_v2(p, *tiles, init, per_channel_decay=False)
        return o.astype(jnp.float32), final, ckpts[:lay.checkpoint_pos.shape[0]], lay.token_valid, lay.checkpoint_valid

    o, final, ckpts, token_valid, checkpoint_valid = jax.device_get(call(x, jnp.asarray(init)))
    np.testing.assert_array_equal(o[~token_valid], 0, err_msg="padding tokens")
    return [o[token_valid], final, ckpts[checkpoint_valid]]


def run_pipelines(x, meta, init, kkt_inverse="f16"):
    """(fused, unfused, float64): each (o of the real tokens, final states, checkpoints)."""
    import jax.numpy as jnp

    from jaxckpt.ops.delta_rule.reference import gated_delta_rule as gdn_reference

    num_real = int(meta["cu_seqlens"][-1])
    args = [np.asarray(jnp.asarray(x[name], jnp.float32))[:num_real] for name in ("q", "k", "v", "g", "beta")]
    expected = gdn_reference(*args, initial_state=init, **meta)
    return run("fused", x, meta, init, kkt_inverse), run("unfused", x, meta, init), expected


def check(label, fused, unfused, expected):
    for name, f, u, e in zip(("o", "final", "checkpoints"), fused, unfused, expected):
        assert f.shape == e.shape and np.isfinite(f).all(), (label, name)
        err_f, err_u = rel_rms(f, e), rel_rms(u, e)
        print(f"{label} {name}: rel-RMS vs float64 fused {err_f:.2e} unfused {err_u:.2e}; "
              f"fused vs unfused {rel_rms(f, u):.2e}")
        assert err_f <= BF16_TOL, (label, name, err_f)
        assert err_f <= 1.1 * err_u + 1e-5, (label, name, err_f, err_u)  # no worse than the current pipeline


@pytest.mark.parametrize("kkt_inverse", ["f16", "blocked"])
@pytest.mark.parametrize("mild", [False, True], ids=["softplus", "mild"])
def test_real_shape_against_float64_and_unfused(mild, kkt_inverse):
    # (1, 8192, 16), K = V = 128: checkpoints at 1, on chunk boundaries (position 0), two in one chunk, at T - 1.
    # kkt_inverse "blocked": gdn_kkt's substitution for T0's diagonal blocks, which runs only here
    import jax

    assert jax.default_backend() == "gpu"
    offsets = [np.array([1, 640, 1000, 1030, 4096, 8191])]
    case = make_case(20261130, [8192], offsets, heads=16, group=1, mild=mild)
    check(f"1x8192x16 {'mild' if mild else 'softplus'} decay kkt {kkt_inverse}", *run_pipelines(*case, kkt_inverse))


def test_kkt_blocked_inverse_against_float64():
    # T0 of every chunk with the substitution ("blocked") and with the doubling ("f16"): both in the fp16 class
    # against a float64 inverse of the masked chunk (module docstring of delta_rule.pallas_mosaic_gpu.intra: ~1e-3 of max |T0|)
    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.delta_rule import cumsum
    from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import gdn_fused as fused

    x, meta, _ = make_case(11, [3000, 1, 1189], [np.array([], np.int64)] * 3, heads=2, group=2, padding=2)
    p = cumsum.prepare(x["q"], x["k"], x["v"], x["g"], x["beta"], per_channel_decay=False, scale=None,
                             use_qk_l2norm=False, cu_seqlens=jnp.asarray(meta["cu_seqlens"]), checkpoint_cu=None,
                             checkpoint_offsets=None, chunk_size=64, interpret=False)
    lay = p.lay
    t0 = {inverse: np.asarray(jnp.asarray(fused.gdn_kkt(lay.chunk_start, lay.chunk_len, p.q, p.k, p.v, p.beta,
                                                        group=2, inverse=inverse)[0], jnp.float32), np.float64)
          for inverse in fused.KKT_INVERSES}
    k, beta = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (p.k, p.beta))
    worst = dict.fromkeys(t0, 0.0)
    for c, (start, length) in enumerate(zip(*jax.device_get((lay.chunk_start, lay.chunk_len)))):
        for h in range(4):
            kc, b = np.zeros((64, k.shape[-1])), np.zeros(64)
            kc[:length], b[:length] = k[start:start + length, h // 2], beta[start:start + length, h]
            exact = np.linalg.inv(np.eye(64) + np.tril(b[:, None] * (kc @ kc.T), -1))
            for inverse, t in t0.items():
                worst[inverse] = max(worst[inverse], np.abs(t[h, c] - exact).max() / np.abs(exact).max())
    print(f"gdn_kkt T0 max |T0 - exact| / max |exact|: {worst}")
    assert max(worst.values()) <= 1e-2, worst


@pytest.mark.parametrize("heads, group", [(4, 1), (2, 2)])
def test_varlen_rows_off_the_tile_grid(heads, group):
    # rows starting at 3000 and 3001 (off the 8-row TMA grid), a 1-token row, NaN padding past the last row whose
    # last TMA window also runs past T
    offsets = [np.array([64, 2999]), np.array([], np.int64), np.array([5, 37, 64, 5000])]
    x, meta, init = make_case(7, [3000, 1, 5189], offsets, heads=heads, group=group, padding=2)
    fused, unfused, expected = run_pipelines(x, meta, init)
    check(f"varlen H {heads} group {group}", fused, unfused, expected)
    # checkpoints leave the outputs and final states bitwise unchanged (the carried state never depends on them)
    plain = dict(meta, checkpoint_cu=np.zeros(len(meta["cu_seqlens"]), np.int32),
                 checkpoint_offsets=np.zeros(0, np.int32))
    without = run("fused", x, plain, init)
    np.testing.assert_array_equal(fused[0], without[0])
    np.testing.assert_array_equal(fused[1], without[1])


def test_map_mode_matches_plain_lanes():
    # the lanes' affine maps [M | E] applied to the start states give the plain lanes' end states (mild decay, so
    # that M S0 is a fair part of them)
    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.delta_rule import cumsum
    from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import gdn_fused as fused

    x, meta, init = make_case(3, [4096, 1500], [np.array([], np.int64)] * 2, heads=4, group=2, mild=True)
    p = cumsum.prepare(x["q"], x["k"], x["v"], x["g"], x["beta"], per_channel_decay=False, scale=None,
                             use_qk_l2norm=False, cu_seqlens=jnp.asarray(meta["cu_seqlens"]), checkpoint_cu=None,
                             checkpoint_offsets=None, chunk_size=64, interpret=False)
    lay = p.lay
    t0, q_c, k_c, v_c, beta_c = fused.gdn_kkt(lay.chunk_start, lay.chunk_len, p.q, p.k, p.v, p.beta, group=2)
    # short lanes (M of a long one is ~0 however mild the decay: the delta rule's factors contract too): pieces of
    # the first row, the second row's first three chunks and its partial last one
    first, count = jnp.array([0, 1, 3, 64, 87], jnp.int32), jnp.array([1, 2, 3, 3, 1], jnp.int32)
    lane_init = jnp.asarray(np.concatenate([init[:1], init[:1], init[:1], init[1:], init[1:]]))
    common = (first, count, lay.chunk_start, lay.chunk_len, q_c, k_c, v_c, beta_c, p.G, t0)
    _, ends, _ = fused.gdn_fused_lanes(*common, lane_init, group=2, scale=p.scale, num_tokens=p.q.shape[0])
    maps = fused.gdn_fused_lanes(*common, None, group=2, scale=p.scale, map_mode=True)
    ends, maps, lane_init = (np.asarray(a, np.float64) for a in jax.device_get((ends, maps, lane_init)))
    K = lane_init.shape[-2]
    composed = maps[..., :K] @ lane_init + maps[..., K:]
    print(f"map_mode: rel-RMS of M S0 + E vs the plain lanes' ends {rel_rms(composed, ends):.2e}; |M S0| / |end| "
          f"{np.linalg.norm(maps[..., :K] @ lane_init) / np.linalg.norm(ends):.2f}")
    assert rel_rms(composed, ends) <= 1e-4
