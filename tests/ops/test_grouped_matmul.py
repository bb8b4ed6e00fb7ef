"""Grouped matmul (`jaxckpt.ops.grouped_matmul`): the XLA path and the Pallas Triton kernel (interpret=True) against
a float64 numpy loop over the groups; the tile table's coverage; gradients; traced group sizes; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt.ops.grouped_matmul import GroupedMatmulConfig, api, default_config, grouped_matmul, pallas_triton

HIGHEST = jax.lax.Precision.HIGHEST
SMALL = GroupedMatmulConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
M, K, N, G = 100, 48, 40, 6  # M is not a multiple of the 16-row tile


def reference(lhs, rhs, sizes):
    """float64 numpy: rows of group g times rhs[g], rows past the groups 0."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        out[start:start + size] = lhs[start:start + size] @ rhs[g]
        start += size
    return out


def reference_grads(lhs, rhs, sizes, dout):
    lhs, rhs, dout = (np.asarray(x, np.float64) for x in (lhs, rhs, dout))
    dlhs, drhs = np.zeros_like(lhs), np.zeros_like(rhs)
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        rows = slice(start, start + size)
        dlhs[rows] = dout[rows] @ rhs[g].T
        drhs[g] = lhs[rows].T @ dout[rows]
        start += size
    return dlhs, drhs


def random_sizes(rng, num_rows, num_groups, total=None):
    """Random sizes summing to `total` (default num_rows), about a third of the groups empty."""
    total = num_rows if total is None else total
    weights = rng.exponential(size=num_groups) * (rng.random(num_groups) > 0.35)
    if not weights.any():
        weights[rng.integers(num_groups)] = 1.0
    sizes = np.floor(weights / weights.sum() * total).astype(np.int32)
    sizes[np.flatnonzero(weights)[0]] += total - sizes.sum()
    return sizes


def size_cases(rng):
    one = np.zeros(G, np.int32)
    one[2] = M
    return {
        "random": random_sizes(rng, M, G),
        "one group holds all rows": one,
        "sum below M": random_sizes(rng, M, G, total=M - 29),
        "all empty": np.zeros(G, np.int32),
        "tiny groups": np.array([1, 0, 3, 17, 16, 15], np.int32),
    }


def inputs(rng, dtype, shape=(M, K, N, G)):
    num_rows, depth, width, groups = shape
    lhs = jnp.asarray(rng.normal(size=(num_rows, depth)), dtype)
    rhs = jnp.asarray(rng.normal(size=(groups, depth, width)), dtype)
    return lhs, rhs


def check(out, lhs, rhs, sizes, rtol):
    expected = reference(lhs, rhs, sizes)
    err = np.abs(np.asarray(out, np.float64) - expected).max() / max(np.abs(expected).max(), 1.0)
    assert err <= rtol, err
    trailing = int(np.maximum(sizes, 0).sum())
    assert not np.asarray(out, np.float64)[trailing:].any()


@pytest.mark.parametrize("dtype, out_dtype, rtol", [(jnp.float32, None, 1e-5), (jnp.bfloat16, jnp.float32, 1e-5),
                                                     (jnp.bfloat16, None, 8e-3)])
def test_xla_matches_reference(dtype, out_dtype, rtol):
    rng = np.random.default_rng(0)
    lhs, rhs = inputs(rng, dtype)
    for name, sizes in size_cases(rng).items():
        out = grouped_matmul(lhs, rhs, jnp.asarray(sizes), preferred_element_type=out_dtype, implementation="xla")
        assert out.dtype == (lhs.dtype if out_dtype is None else out_dtype), name
        check(out, lhs, rhs, sizes, rtol)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype, out_dtype, rtol", [(jnp.float32, None, 1e-5), (jnp.bfloat16, jnp.float32, 1e-5),
                                                     (jnp.bfloat16, None, 8e-3)])
def test_pallas_matches_reference(dtype, out_dtype, rtol):
    """One compile per dtype: the size cases differ only in the traced group_sizes."""
    rng = np.random.default_rng(1)
    lhs, rhs = inputs(rng, dtype)
    for name, sizes in size_cases(rng).items():
        out = pallas_triton.grouped_matmul(lhs, rhs, jnp.asarray(sizes), preferred_element_type=out_dtype,
                                           precision=HIGHEST, config=SMALL, interpret=True)
        assert out.dtype == (lhs.dtype if out_dtype is None else out_dtype), name
        check(out, lhs, rhs, sizes, rtol)


@pytest.mark.interpret
def test_pallas_default_config_pads_small_and_odd_shapes():
    """M below the default 64-row tile, K and N no multiple of 16 (padded in the wrapper)."""
    rng = np.random.default_rng(2)
    shape = (50, 40, 24, 3)
    lhs, rhs = inputs(rng, jnp.float32, shape)
    sizes = np.array([20, 0, 25], np.int32)
    out = pallas_triton.grouped_matmul(lhs, rhs, jnp.asarray(sizes), precision=HIGHEST, interpret=True)
    check(out, lhs, rhs, sizes, 1e-5)


@pytest.mark.interpret
def test_pallas_under_jit_with_traced_sizes():
    rng = np.random.default_rng(3)
    lhs, rhs = inputs(rng, jnp.float32)

    @jax.jit
    def f(lhs, rhs, sizes):
        return pallas_triton.grouped_matmul(lhs, rhs, sizes, precision=HIGHEST, config=SMALL, interpret=True) * 2.0

    for _ in range(3):
        sizes = random_sizes(rng, M, G, total=int(rng.integers(0, M + 1)))
        out = f(lhs, rhs, jnp.asarray(sizes))
        check(out / 2.0, lhs, rhs, sizes, 1e-5)
    assert f._cache_size() == 1


@pytest.mark.interpret
def test_pallas_grads_match_reference():
    rng = np.random.default_rng(4)
    lhs, rhs = inputs(rng, jnp.float32)
    sizes = random_sizes(rng, M, G, total=M - 13)
    dout = jnp.asarray(rng.normal(size=(M, N)), jnp.float32)

    def loss(lhs, rhs):
        out = pallas_triton.grouped_matmul(lhs, rhs, jnp.asarray(sizes), precision=HIGHEST, config=SMALL,
                                           interpret=True)
        return jnp.sum(out * dout)

    dlhs, drhs = jax.grad(loss, argnums=(0, 1))(lhs, rhs)
    want_lhs, want_rhs = reference_grads(lhs, rhs, sizes, dout)
    np.testing.assert_allclose(np.asarray(dlhs), want_lhs, rtol=0, atol=1e-5 * np.abs(want_lhs).max())
    np.testing.assert_allclose(np.asarray(drhs), want_rhs, rtol=0, atol=1e-5 * np.abs(want_rhs).max())
    assert not np.asarray(drhs)[sizes == 0].any()


@pytest.mark.parametrize("block_m", [16, 64])
def test_tile_table_covers_each_row_once(block_m):
    rng = np.random.default_rng(5)
    for num_rows, groups in [(100, 6), (1000, 37), (64, 1), (7, 4)]:
        for total in (num_rows, int(rng.integers(0, num_rows + 1))):
            sizes = random_sizes(rng, num_rows, groups, total=total)
            group, start, end = (np.asarray(x) for x in pallas_triton.tile_table(jnp.asarray(sizes), num_rows,
                                                                                   block_m))
            assert group.shape == (pallas_triton.num_tiles(num_rows, groups, block_m),)
            owner = np.full(num_rows, -1)
            for g, s, e in zip(group, start, end):
                if g > groups:
                    assert s == e == 0
                    continue
                rows = np.arange(s, min(s + block_m, e))
                assert rows.size and (owner[rows] == -1).all()
                owner[rows] = g
            ends = np.cumsum(sizes)
            assert (owner == np.minimum(np.searchsorted(ends, np.arange(num_rows), side="right"), groups)).all()


def test_sizes_are_clipped_alike_on_both_paths():
    """Negative sizes count as 0 and a sum past M is cut at M: the XLA path and the kernel agree."""
    rng = np.random.default_rng(6)
    lhs, rhs = inputs(rng, jnp.float32, (40, 16, 16, 4))
    sizes = np.array([-5, 30, 0, 50], np.int32)
    clipped = np.array([0, 30, 0, 10], np.int32)
    out = grouped_matmul(lhs, rhs, jnp.asarray(sizes), precision=HIGHEST, implementation="xla")
    check(out, lhs, rhs, clipped, 1e-5)
    kernel = pallas_triton.grouped_matmul(lhs, rhs, jnp.asarray(sizes), precision=HIGHEST, config=SMALL,
                                          interpret=True)
    check(kernel, lhs, rhs, clipped, 1e-5)


def test_default_on_cpu_is_xla_and_pallas_needs_a_gpu():
    assert api._choose(jnp.zeros((4, 4), jnp.bfloat16), jnp.zeros((1, 4, 4), jnp.bfloat16), None) == "xla"
    lhs, rhs, sizes = jnp.zeros((4, 16)), jnp.zeros((2, 16, 16)), jnp.array([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="implementation: 'pallas_triton' cannot run"):
        grouped_matmul(lhs, rhs, sizes, implementation="pallas_triton")
    with pytest.raises(ValueError, match="config: .*'xla'"):
        grouped_matmul(lhs, rhs, sizes, config=SMALL)


def test_kernel_precision_follows_jax_default():
    assert api._kernel_precision(None, jnp.bfloat16) is None
    assert api._kernel_precision(jax.lax.Precision.DEFAULT, jnp.float32) == jax.lax.Precision.DEFAULT
    with jax.default_matmul_precision("highest"):
        assert api._kernel_precision(None, jnp.float32) == HIGHEST
    with jax.default_matmul_precision("tensorfloat32"):
        assert api._kernel_precision(None, jnp.float32) == jax.lax.Precision.DEFAULT


def test_default_config_tiles():
    moe = default_config(81920, 2048, 1024, 512, jnp.bfloat16)
    assert (moe.block_m, moe.block_k) == (64, 64)
    assert default_config(8192 * 8, 512, 512, 8, jnp.float32).block_m == 128
    assert default_config(100, 48, 40, 6, jnp.float32).block_k == 32


@pytest.mark.parametrize("kwargs, match", [
    (dict(lhs=jnp.zeros((4,))), "lhs: must be"),
    (dict(rhs=jnp.zeros((16, 8))), "rhs: must be"),
    (dict(rhs=jnp.zeros((2, 8, 8))), "rhs: K"),
    (dict(lhs=jnp.zeros((4, 16), jnp.int32)), "lhs: dtype"),
    (dict(rhs=jnp.zeros((2, 16, 8), jnp.bfloat16)), "rhs: dtype"),
    (dict(group_sizes=jnp.array([4], jnp.int32)), r"group_sizes: must be \[G\]"),
    (dict(group_sizes=jnp.array([2.0, 2.0])), "group_sizes: dtype"),
    (dict(preferred_element_type=jnp.int32), "preferred_element_type"),
    (dict(precision="highest"), "precision"),
    (dict(config=dict(block_m=16)), "config: must be"),
    (dict(implementation="triton"), "implementation: must be"),
])
def test_bad_input(kwargs, match):
    call = dict(lhs=jnp.zeros((4, 16)), rhs=jnp.zeros((2, 16, 8)), group_sizes=jnp.array([2, 2], jnp.int32))
    call.update(kwargs)
    with pytest.raises(ValueError, match=match):
        grouped_matmul(call.pop("lhs"), call.pop("rhs"), call.pop("group_sizes"), **call)


@pytest.mark.parametrize("field, value", [("block_m", 24), ("block_n", 8), ("block_k", 0), ("num_warps", 3),
                                          ("num_stages", 0)])
def test_bad_config(field, value):
    with pytest.raises(ValueError, match=f"config: {field}"):
        GroupedMatmulConfig(**{field: value})


def test_tile_rows_mask_is_the_tile_range():
    """The store mask alone keeps tiles disjoint on the GPU (interpret runs programs in order, so an overlap
    between neighbouring tiles would be overwritten there unseen)."""
    for start, end, num_rows in [(0, 16, 100), (90, 100, 100), (95, 97, 100), (30, 41, 100), (0, 5, 16)]:
        base, live = (np.asarray(x) for x in pallas_triton._tile_rows(start, end, num_rows, 16))
        rows = base + np.arange(16)
        assert 0 <= base <= num_rows - 16
        assert (rows[live] == np.arange(start, min(start + 16, end))).all()
