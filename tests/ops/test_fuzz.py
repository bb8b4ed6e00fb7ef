"""Random batches against the float64 token-by-token reference, on every path the CPU runs (hypothesis).

Each bucket is one compiled program with traced metadata (`jax.jit`), so hundreds of batches cost no recompiles:
row lengths include 0, 1 and chunk multiples +- 1, rows continue an initial state or start fresh, up to three
checkpoints per row, GVA, a few tokens with a zero decay (-inf, a state reset) or a strong one (-1e4), and NaN in
every padding token. The paged form runs over a NaN-filled pool: only the slots named are read or written.
"""

import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ops.fuzz_cases import (
    CHUNK,
    SPECIAL_LENGTHS,
    Batch,
    Bucket,
    call,
    call_paged,
    errors,
    interpret_config,
    random_batch,
)

FP32_CLASS = 1e-5  # rel-RMS against float64 (documented in the op READMEs)

BUCKETS = {
    "gdn": Bucket("gdn", tokens=320, rows=4, checkpoints=6, heads=1, v_heads=2, key=8, value=8),
    "kda": Bucket("kda", tokens=320, rows=4, checkpoints=6, heads=2, v_heads=2, key=8, value=4),
    "ssd": Bucket("ssd", tokens=320, rows=4, checkpoints=6, heads=4, v_heads=2, key=4, value=8),
    "conv1d": Bucket("conv1d", tokens=320, rows=4, checkpoints=6, heads=6, key=4),
}
EXAMPLES = {"gdn": 500, "kda": 400, "ssd": 500, "conv1d": 500}  # fresh seeds every run (no database)

lengths_st = st.lists(st.one_of(st.sampled_from(SPECIAL_LENGTHS), st.integers(0, 3 * CHUNK)), min_size=4,
                      max_size=4).filter(lambda ls: sum(ls) <= 320)


@functools.cache
def compiled(bucket: Bucket, method: str):
    def run(arrays, params, initial_state, cu_seqlens, checkpoint_cu, checkpoint_offsets):
        batch = Batch(bucket, arrays, params, initial_state, None, cu_seqlens, checkpoint_cu, checkpoint_offsets)
        return call(batch, "xla", **({} if bucket.op == "conv1d" else dict(checkpoint_method=method)))
    return jax.jit(run)


def run_xla(batch: Batch, method: str):
    fn = compiled(batch.bucket, method)
    return [np.asarray(x) for x in fn(batch.arrays, batch.params, batch.initial_state, batch.cu_seqlens,
                                      batch.checkpoint_cu, batch.checkpoint_offsets)]


def reference(batch: Batch):
    return [np.asarray(x) for x in call(batch, "reference")]


def assert_matches(batch: Batch, result, expected):
    found = errors(batch, result, expected)
    assert all(e <= FP32_CLASS for e in found.values()), (found, batch.cu_seqlens, batch.checkpoint_cu)


@pytest.mark.parametrize("op", sorted(BUCKETS))
def test_xla_traced_metadata_matches_float64(op):
    bucket = BUCKETS[op]
    methods = ("in_chunk",) if op == "conv1d" else ("in_chunk", "forced_break")

    @settings(max_examples=EXAMPLES[op], deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(lengths=lengths_st, seed=st.integers(0, 2 ** 32 - 1), method=st.sampled_from(methods))
    def check(lengths, seed, method):
        batch = random_batch(np.random.default_rng(seed), bucket, lengths=lengths)
        assert_matches(batch, run_xla(batch, method), reference(batch))

    check()


def paged_slots(rng, batch: Batch):
    """A NaN-filled pool with the continued rows' states in it; slots read, written and left alone."""
    n, m = batch.bucket.rows, batch.bucket.checkpoints
    num_slots = 2 + 2 * n + m
    pool = np.full((num_slots, *batch.state_shape), np.nan, np.float32)
    order = rng.permutation(np.arange(1, num_slots))
    initial, final, ckpt = order[:n], order[n:2 * n], order[2 * n:2 * n + m].copy()
    ckpt[batch.real_checkpoints:] = 0
    # a fresh row names a slot too (vLLM's do): its NaN must not be read
    pool[initial[batch.has_initial_state]] = batch.initial_state[batch.has_initial_state]
    return pool, dict(initial_state_indices=initial.astype(np.int32), has_initial_state=batch.has_initial_state,
                      final_state_indices=final.astype(np.int32), checkpoint_state_indices=ckpt.astype(np.int32))


@pytest.mark.parametrize("implementation", ["xla", "reference"])
@pytest.mark.parametrize("op", sorted(BUCKETS))
def test_paged_nan_pool(op, implementation):
    bucket = BUCKETS[op]

    @settings(max_examples=12 if implementation == "xla" else 6, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(lengths=lengths_st, seed=st.integers(0, 2 ** 32 - 1))
    def check(lengths, seed):
        rng = np.random.default_rng(seed)
        batch = random_batch(rng, bucket, lengths=lengths)
        pool, slots = paged_slots(rng, batch)
        out, new_pool = call_paged(batch, implementation, pool.copy(), **slots)
        new_pool = np.asarray(new_pool)
        expected = reference(batch)
        m = batch.real_checkpoints
        written = np.concatenate([slots["final_state_indices"], slots["checkpoint_state_indices"][:m]])
        assert_matches(batch, [out, new_pool[slots["final_state_indices"]],
                               new_pool[slots["checkpoint_state_indices"]]], expected)
        untouched = np.setdiff1d(np.arange(pool.shape[0]), written)
        np.testing.assert_array_equal(new_pool[untouched], pool[untouched])  # NaN slots stay NaN, bit for bit

    check()


@pytest.mark.parametrize("op", ["gdn", "kda", "ssd"])
def test_split_matches_float64(op):
    bucket = BUCKETS[op]

    @settings(max_examples=2, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(lengths=lengths_st, seed=st.integers(0, 2 ** 32 - 1))
    def check(lengths, seed):
        batch = random_batch(np.random.default_rng(seed), bucket, lengths=lengths)
        assert_matches(batch, [np.asarray(x) for x in call(batch, "xla", checkpoint_method="split")],
                       reference(batch))

    check()


PALLAS_BUCKETS = {
    ("pallas_triton", "gdn"): Bucket("gdn", tokens=192, rows=3, checkpoints=4, heads=1, v_heads=2, key=16, value=16),
    ("pallas_triton", "kda"): Bucket("kda", tokens=192, rows=3, checkpoints=4, heads=1, v_heads=1, key=16, value=16),
    ("pallas_triton", "ssd"): Bucket("ssd", tokens=192, rows=3, checkpoints=4, heads=2, v_heads=1, key=16, value=16),
}


@pytest.mark.interpret
@pytest.mark.parametrize("implementation,op", sorted(PALLAS_BUCKETS))
def test_pallas_interpret_matches_float64(implementation, op):
    bucket = PALLAS_BUCKETS[implementation, op]
    lengths = st.lists(st.one_of(st.sampled_from(SPECIAL_LENGTHS), st.integers(0, 2 * CHUNK)), min_size=3,
                       max_size=3).filter(lambda ls: sum(ls) <= bucket.tokens)

    @settings(max_examples=15, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(lengths=lengths, seed=st.integers(0, 2 ** 32 - 1))
    def check(lengths, seed):
        batch = random_batch(np.random.default_rng(seed), bucket, lengths=lengths)
        config = interpret_config(bucket.op, implementation)
        result = [np.asarray(x) for x in call(batch, implementation, config=config)]
        assert_matches(batch, result, reference(batch))

    check()
