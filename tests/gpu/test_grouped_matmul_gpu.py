"""The grouped matmul's Pallas Triton kernel on a GPU: Qwen3-Next MoE shapes against fp32 products per group, and
smaller shapes against jax.lax.ragged_dot (where its dense lowering fits) and a float64 numpy loop.

Run on the GPU machine: `JAXCKPT_GPU_TESTS=1 JAX_PLATFORMS=cuda python -m pytest -q tests/gpu/test_grouped_matmul_gpu.py`.
"""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _reference(lhs, rhs, sizes):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = lhs[start:start + size] @ rhs[g]
        start += size
    return out


def _routing(rng, tokens, experts, top_k):
    picks = np.argpartition(rng.random((tokens, experts), dtype=np.float32), top_k, axis=1)[:, :top_k]
    return np.bincount(picks.reshape(-1), minlength=experts).astype(np.int32)


def _rel(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return np.abs(actual - expected).max(initial=0.0) / max(np.abs(expected).max(initial=0.0), 1e-30)


@pytest.mark.parametrize("depth, width", [(2048, 1024), (512, 2048)])
def test_qwen3_next_shapes(depth, width):
    """T = 8192 tokens, top-10 of 512 experts: M = 81920 pairs, bf16 in and out, the default implementation."""
    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.grouped_matmul import api, grouped_matmul

    rng = np.random.default_rng(depth)
    sizes = _routing(rng, 8192, 512, 10)
    sizes[rng.choice(512, 8, replace=False)] = 0  # empty experts too; their rows become trailing rows (zeros)
    rows = 81920
    key = jax.random.key(depth)
    lhs = jax.random.normal(key, (rows, depth), jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.fold_in(key, 1), (512, depth, width)) * depth ** -0.5).astype(jnp.bfloat16)
    assert api._choose(lhs, rhs, None) == "pallas_triton"
    out = jax.block_until_ready(jax.jit(grouped_matmul)(lhs, rhs, jnp.asarray(sizes)))
    assert out.shape == (rows, width) and out.dtype == jnp.bfloat16
    # checked on the host: slicing device arrays per group would compile a program per group size
    out, lhs, rhs = (np.asarray(a.astype(jnp.float32)) for a in (out, lhs, rhs))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    smallest = int(np.flatnonzero(sizes)[np.argmin(sizes[sizes > 0])])
    for g in {int(np.argmax(sizes)), smallest, *rng.choice(512, 24, replace=False).tolist()}:
        span = slice(int(starts[g]), int(starts[g] + sizes[g]))
        assert _rel(out[span], lhs[span] @ rhs[g]) < 1e-2, g
    assert not out[int(sizes.sum()):].any()


@pytest.mark.parametrize("dtype, precision, tol", [("bfloat16", None, 1e-5), ("float32", "HIGHEST", 1e-5),
                                                   ("float32", "DEFAULT", 3e-3)])
def test_against_ragged_dot_and_float64(dtype, precision, tol):
    """M 4000 (no tile multiple), sum 3900 < M, empty groups and one large group; fp32 out."""
    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.grouped_matmul import grouped_matmul

    rng = np.random.default_rng(7)
    rows, depth, width, groups = 4000, 256, 384, 16
    sizes = _routing(rng, 390, groups, 10)
    sizes[[1, 5]] = 0
    sizes[9] += 3900 - sizes.sum()
    lhs = jnp.asarray(rng.normal(size=(rows, depth)), dtype)
    rhs = jnp.asarray(rng.normal(size=(groups, depth, width)) * depth ** -0.5, dtype)
    prec = None if precision is None else getattr(jax.lax.Precision, precision)
    call = dict(preferred_element_type=jnp.float32, precision=prec)
    out = grouped_matmul(lhs, rhs, jnp.asarray(sizes), implementation="pallas_triton", **call)
    want = _reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
    assert _rel(out, want) < tol
    ragged = grouped_matmul(lhs, rhs, jnp.asarray(sizes), implementation="xla", **call)
    assert _rel(out, ragged) < max(tol, 1e-5) * 2
    assert not np.asarray(out[3900:]).any()


def test_traced_sizes_one_compile():
    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.grouped_matmul import grouped_matmul

    rng = np.random.default_rng(8)
    rows, depth, width, groups = 3000, 128, 256, 64
    lhs = jnp.asarray(rng.normal(size=(rows, depth)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(groups, depth, width)) * depth ** -0.5, jnp.bfloat16)
    f = jax.jit(lambda lhs, rhs, sizes: grouped_matmul(lhs, rhs, sizes, preferred_element_type=jnp.float32))
    for total in (rows, 1234, 0):
        sizes = _routing(rng, max(total, 1), groups, 1) if total else np.zeros(groups, np.int32)
        out = f(lhs, rhs, jnp.asarray(sizes))
        assert _rel(out, _reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)) < 1e-5
    assert f._cache_size() == 1


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_grads_against_ragged_dot(dtype, tol):
    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.grouped_matmul import grouped_matmul

    rng = np.random.default_rng(9)
    rows, depth, width, groups = 2000, 256, 128, 8
    sizes = _routing(rng, 950, groups, 2)
    sizes[3] = 0
    lhs = jnp.asarray(rng.normal(size=(rows, depth)), dtype)
    rhs = jnp.asarray(rng.normal(size=(groups, depth, width)) * depth ** -0.5, dtype)
    dout = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)

    def grads(implementation):
        def loss(lhs, rhs):
            out = grouped_matmul(lhs, rhs, jnp.asarray(sizes), preferred_element_type=jnp.float32,
                                 precision=jax.lax.Precision.HIGHEST, implementation=implementation)
            return jnp.sum(out * dout)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)

    for mine, theirs in zip(grads("pallas_triton"), grads("xla")):
        assert _rel(mine.astype(jnp.float32), theirs.astype(jnp.float32)) < tol
