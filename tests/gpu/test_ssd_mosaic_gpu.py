"""The Mosaic GPU SSD on the H200 at real head sizes: against the float64 reference on the same bf16 inputs (varlen
rows off the chunk grid, checkpoints inside chunks, NaN padding tokens, a last chunk reaching past the last
token), with the sequence split, and batched rows; outputs and final states bitwise unchanged by checkpoints; the z
gate fused into the kernel (z in two tiles beside the TMA ring) rounds y once.

Run on the GPU machine: `JAXCKPT_GPU_TESTS=1 JAX_PLATFORMS=cuda python -m pytest -q -s tests/gpu/test_ssd_mosaic_gpu.py`.
"""

import numpy as np
import pytest

from tests.numerics import rel_rms

pytestmark = pytest.mark.gpu

TOL = 6e-3  # the bf16 class (FLA's own output error is 3-4e-3 on such inputs)


def problem(seed, lengths, heads, groups, P=64, N=128, padding=7, gate=False):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    T = sum(lengths) + padding
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    x = rng.standard_normal((T, heads, P))
    x[sum(lengths):] = np.nan
    arrays = dict(x=bf(x), dt=jnp.asarray(rng.standard_normal((T, heads)) - 1.5, jnp.float32),
                  A=jnp.asarray(-np.exp(rng.uniform(0, 2, heads)), jnp.float32),
                  B=bf(rng.standard_normal((T, groups, N)) / np.sqrt(N)),
                  C=bf(rng.standard_normal((T, groups, N)) / np.sqrt(N)),
                  D=jnp.asarray(rng.standard_normal(heads), jnp.float32),
                  dt_bias=jnp.asarray(rng.standard_normal(heads) * 0.5, jnp.float32))
    if gate:
        z = rng.standard_normal((T, heads, P))
        z[sum(lengths):] = np.nan
        arrays["z"] = bf(z)
    h0 = (rng.standard_normal((len(lengths), heads, P, N)) * 0.1).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return arrays, h0, cu


# padding 0: the last row's partial chunk reads its TMA box past the last token (zero-filled rows)
@pytest.mark.parametrize("pieces, padding", [(1, 7), (3, 0), ("auto", 7)])
def test_varlen_checkpoints_against_float64(pieces, padding):
    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.ssd import pallas_mosaic_gpu as mosaic
    from jaxckpt.ops.ssd.reference import ssd as reference

    lengths = [3001, 1, 700, 2000]
    arrays, h0, cu = problem(5, lengths, heads=8, groups=2, padding=padding)
    meta = dict(cu_seqlens=cu, checkpoint_cu=np.array([0, 3, 3, 4, 5], np.int32),
                checkpoint_offsets=np.array([1, 1024, 2999, 64, 1999], np.int32))
    expected = reference(**arrays, initial_state=h0, **meta)
    run = jax.jit(lambda cu, ccu, off: mosaic.ssd(**arrays, initial_state=jnp.asarray(h0), cu_seqlens=cu,
                                                  checkpoint_cu=ccu, checkpoint_offsets=off, pieces=pieces))
    got = run(*(jnp.asarray(meta[k]) for k in ("cu_seqlens", "checkpoint_cu", "checkpoint_offsets")))
    valid = cu[-1]
    errors = (rel_rms(got[0][:valid], expected[0][:valid]), rel_rms(got[1], expected[1]), rel_rms(got[2], expected[2]))
    print(f"ssd mosaic pieces={pieces} y {errors[0]:.2e} final {errors[1]:.2e} checkpoints {errors[2]:.2e}")
    assert errors[0] < TOL and errors[1] < 1e-4 and errors[2] < 1e-4, errors
    assert np.all(np.asarray(got[0][valid:], np.float32) == 0)  # padding tokens (NaN inputs) come back zero
    plain = jax.jit(lambda cu: mosaic.ssd(**arrays, initial_state=jnp.asarray(h0), cu_seqlens=cu,
                                          pieces=pieces))(jnp.asarray(cu))
    np.testing.assert_array_equal(np.asarray(plain[0], np.float32), np.asarray(got[0], np.float32))
    np.testing.assert_array_equal(np.asarray(plain[1]), np.asarray(got[1]))


# stages None: the 4-slot ring beside z's own two tiles at N = 128; 2: z's tiles refilled from a shallow ring
@pytest.mark.parametrize("pieces, stages", [(1, None), (2, None), (1, 2)])
def test_fused_gate_against_float64(pieces, stages):
    """y * silu(z) in the output warpgroup (NaN z in the padding tokens and past the last row's partial chunk): one
    bf16 rounding, below gating the kernel's rounded y and rounding again; the states do not see the gate."""
    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.ssd import pallas_mosaic_gpu as mosaic
    from jaxckpt.ops.ssd.reference import ssd as reference

    lengths = [3001, 1, 700, 2000]
    arrays, h0, cu = problem(7, lengths, heads=8, groups=2, padding=7, gate=True)
    meta = dict(cu_seqlens=cu, checkpoint_cu=np.array([0, 2, 2, 3, 3], np.int32),
                checkpoint_offsets=np.array([1000, 2999, 65], np.int32))
    expected = reference(**arrays, initial_state=h0, **meta)
    run = jax.jit(lambda z: mosaic.ssd(**{**arrays, "z": z}, initial_state=jnp.asarray(h0), **meta, pieces=pieces,
                                       stages=stages))
    got, plain = run(arrays["z"]), run(None)
    valid = cu[-1]
    z = np.asarray(arrays["z"], np.float32)[:valid]
    unfused = np.asarray(jnp.asarray(np.asarray(plain[0], np.float32)[:valid] * z / (1 + np.exp(-z)), jnp.bfloat16))
    errors = (rel_rms(got[0][:valid], expected[0][:valid]), rel_rms(unfused, expected[0][:valid]),
              rel_rms(got[1], expected[1]), rel_rms(got[2], expected[2]))
    print(f"ssd mosaic z pieces={pieces} stages={stages} y fused {errors[0]:.2e} gated after rounding {errors[1]:.2e} "
          f"final {errors[2]:.2e} checkpoints {errors[3]:.2e}")
    assert errors[0] < TOL and errors[0] < 0.9 * errors[1] and errors[2] < 1e-4 and errors[3] < 1e-4, errors
    assert np.all(np.asarray(got[0][valid:], np.float32) == 0)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(plain[1]))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(plain[2]))


def test_batched_rows_against_float64():
    import jax
    import jax.numpy as jnp

    from jaxckpt import ops
    from jaxckpt.ops.ssd.reference import ssd as reference

    arrays, h0, cu = problem(6, [4096, 4096], heads=4, groups=1, padding=0)
    expected = reference(**arrays, initial_state=h0, cu_seqlens=cu)
    batched = {k: (v.reshape(2, 4096, *v.shape[1:]) if k in ("x", "dt", "B", "C") else v) for k, v in arrays.items()}
    got = jax.jit(lambda: ops.ssd(**batched, initial_state=jnp.asarray(h0), implementation="pallas_mosaic_gpu"))()
    y = np.asarray(got[0], np.float32).reshape(8192, *got[0].shape[2:])
    errors = rel_rms(y, expected[0]), rel_rms(got[1], expected[1])
    print(f"ssd mosaic batched y {errors[0]:.2e} final {errors[1]:.2e}")
    assert errors[0] < TOL and errors[1] < 1e-4, errors
