"""Bad calls of the public op entries: each raises a ValueError that names the argument, before anything runs, and
leaves the pool as it was (eager and, for the shape rules, under `jax.jit` with traced metadata)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt import ops

T, H, K = 24, 2, 8
CU = np.array([0, 10, 24], np.int32)
CCU = np.array([0, 1, 1], np.int32)
OFFSETS = np.array([5], np.int32)


def gdn_arrays(rng):
    k = rng.standard_normal((T, H, K)).astype(np.float32)
    return dict(q=rng.standard_normal((T, H, K)).astype(np.float32), k=k / np.linalg.norm(k, axis=-1, keepdims=True),
                v=rng.standard_normal((T, H, K)).astype(np.float32), g=-np.full((T, H), 0.1, np.float32),
                beta=np.full((T, H), 0.5, np.float32))


def paged_args(**changes):
    args = dict(initial_state_indices=np.array([1, 2], np.int32), has_initial_state=np.array([True, False]),
                final_state_indices=np.array([3, 4], np.int32), checkpoint_state_indices=np.array([5], np.int32),
                cu_seqlens=CU, checkpoint_cu=CCU, checkpoint_offsets=OFFSETS, implementation="xla", donate=False)
    args.update(changes)
    return args


POOL = (8, H, K, K)
# (argument the error must name, changes to a valid paged GDN call)
PAGED_CASES = [
    ("cu_seqlens", dict(cu_seqlens=np.array([True, False, True]))),
    ("cu_seqlens", dict(cu_seqlens=np.array([0, 30, 24], np.int32))),
    ("cu_seqlens", dict(cu_seqlens=np.array([0.0, 10.0, 24.0]))),
    ("checkpoint_cu", dict(checkpoint_cu=np.array([0, 1], np.int32))),
    ("checkpoint_cu", dict(checkpoint_cu=np.array([0, 2, 1], np.int32))),
    ("checkpoint_offsets", dict(checkpoint_offsets=np.array([10], np.int32))),
    ("checkpoint_offsets", dict(checkpoint_offsets=np.array([[5]], np.int32))),
    ("checkpoint_state_indices", dict(checkpoint_state_indices=np.array([5, 6], np.int32))),
    ("checkpoint_state_indices", dict(checkpoint_state_indices=np.array([9], np.int32))),
    ("checkpoint_state_indices", dict(checkpoint_state_indices=np.array([1.0]))),
    ("initial_state_indices", dict(initial_state_indices=np.array([1], np.int32))),
    ("initial_state_indices", dict(initial_state_indices=np.array([-1, 2], np.int32))),
    ("initial_state_indices", dict(initial_state_indices=np.array([True, False]))),
    ("has_initial_state", dict(has_initial_state=np.array([True]))),
    ("has_initial_state", dict(has_initial_state=None)),
    ("has_initial_state", dict(has_initial_state=np.array([1, 0], np.int32))),
    ("final_state_indices", dict(final_state_indices=np.array([3, 4, 5], np.int32))),
    ("final_state_indices", dict(final_state_indices=np.array([3, 8], np.int32))),
    ("final_state_indices", dict(final_state_indices=np.array([3, 5], np.int32))),  # checkpoint writes 5 too
    ("num_decodes", dict(num_decodes=3)),
    ("num_decodes", dict(num_decodes=-1)),
    ("num_decodes", dict(num_decodes=True)),
    ("scale", dict(scale=np.float32(0.5) * np.ones(1))),
    ("scale", dict(scale=float("nan"))),
    ("use_qk_l2norm", dict(use_qk_l2norm="yes")),
    ("donate", dict(donate=None)),
    ("checkpoint_method", dict(checkpoint_method="late")),
    ("implementation", dict(implementation="fast")),
]


@pytest.mark.parametrize("name,changes", PAGED_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(PAGED_CASES)])
def test_bad_paged_call_names_its_argument_and_writes_nothing(name, changes):
    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.standard_normal(POOL).astype(np.float32))
    before = np.asarray(pool)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        ops.gated_delta_rule_paged(**gdn_arrays(rng), state_pool=pool, **paged_args(**changes))
    np.testing.assert_array_equal(np.asarray(pool), before)


@pytest.mark.parametrize("pool,rule", [(np.zeros((8, H, K, K), np.int32), "dtype"),
                                       (np.zeros((8, H, K, K + 1), np.float32), "expected"),
                                       (np.zeros((0, H, K, K), np.float32), "expected")])
def test_bad_state_pool(pool, rule):
    with pytest.raises(ValueError, match=rf"^state_pool: {rule}"):
        ops.gated_delta_rule_paged(**gdn_arrays(np.random.default_rng(1)), state_pool=pool, **paged_args())


@pytest.mark.parametrize("name,changes", [
    ("initial_state", dict(initial_state=np.zeros((1, H, K, K), np.float32))),
    ("initial_state", dict(initial_state=np.zeros((2, H, K, K), np.int32))),
    ("num_decodes", dict(num_decodes=5)),
    ("cu_seqlens", dict(cu_seqlens=np.array([[0, 24]], np.int32))),
])
def test_bad_dense_call(name, changes):
    args = dict(cu_seqlens=CU, checkpoint_cu=CCU, checkpoint_offsets=OFFSETS, implementation="xla")
    args.update(changes)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        ops.gated_delta_rule(**gdn_arrays(np.random.default_rng(2)), **args)


@pytest.mark.parametrize("name,changes", [
    ("has_initial_state", dict(has_initial_state=jnp.array([True]))),
    ("final_state_indices", dict(final_state_indices=jnp.array([3, 4], jnp.float32))),
    ("checkpoint_state_indices", dict(checkpoint_state_indices=jnp.array([5, 6], jnp.int32))),
    ("cu_seqlens", dict(cu_seqlens=jnp.array([True, False, True]))),
])
def test_bad_traced_call_names_its_argument(name, changes):
    """Under jit the values are unknown, the shapes and dtypes are not: they are checked the same way."""
    rng = np.random.default_rng(3)
    args = paged_args(**changes)
    traced = {k: args.pop(k) for k in ("initial_state_indices", "has_initial_state", "final_state_indices",
                                       "checkpoint_state_indices", "cu_seqlens", "checkpoint_cu",
                                       "checkpoint_offsets")}

    @jax.jit
    def run(pool, meta):
        return ops.gated_delta_rule_paged(**gdn_arrays(rng), state_pool=pool, **meta, **args)

    with pytest.raises(ValueError, match=rf"^{name}\b"):
        run(jnp.zeros(POOL, jnp.float32), traced)


def test_ssd_and_conv1d_pools_are_checked_by_name():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((T, 2, 4)).astype(np.float32)
    B = rng.standard_normal((T, 1, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="^state_pool: expected"):
        ops.ssd_paged(x, np.zeros((T, 2), np.float32), -np.ones(2, np.float32), B, B, np.zeros((8, 2, 8, 4)),
                      **paged_args())
    with pytest.raises(ValueError, match="^has_initial_state: dtype"):
        ops.causal_conv1d_paged(rng.standard_normal((T, 6)).astype(np.float32), np.ones((6, 4), np.float32),
                                np.zeros((8, 6, 3), np.float32), **paged_args(has_initial_state=np.array([1, 1])))
