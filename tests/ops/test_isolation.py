"""One row never touches another: poison one row, its initial state or the padding, and every other row's outputs,
final state and checkpoint states come out bit for bit as before, on every implementation and checkpoint method.

Also: under traced metadata a slot outside the pool (e.g. vLLM's -1) reads as a fresh state and writes nothing.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.ops.fuzz_cases import Batch, Bucket, call, call_paged, interpret_config, random_batch

POISONS = (np.nan, np.inf, -np.inf, 3e38)
BUCKETS = {
    "gdn": Bucket("gdn", tokens=200, rows=3, checkpoints=4, heads=1, v_heads=2, key=16, value=16),
    "kda": Bucket("kda", tokens=200, rows=3, checkpoints=4, heads=1, v_heads=1, key=16, value=16),
    "ssd": Bucket("ssd", tokens=200, rows=3, checkpoints=4, heads=2, v_heads=1, key=16, value=16),
    "conv1d": Bucket("conv1d", tokens=200, rows=3, checkpoints=4, heads=4, key=4),
}
MOSAIC_BUCKETS = {  # Mosaic GPU: 16-bit inputs, K = V = 64 at the least, one key head per value head
    "gdn": Bucket("gdn", tokens=200, rows=3, checkpoints=4, heads=1, v_heads=1, key=64, value=64),
    "kda": Bucket("kda", tokens=200, rows=3, checkpoints=4, heads=1, v_heads=1, key=64, value=64),
    "ssd": Bucket("ssd", tokens=200, rows=3, checkpoints=4, heads=1, v_heads=1, key=64, value=64),
}
LENGTHS = (70, 1, 100)  # row 0 spans two chunks, row 1 is one token, row 2 spans two; 29 padding tokens

CASES = ([(op, "reference", "in_chunk") for op in BUCKETS]
         + [(op, "xla", m) for op in ("gdn", "kda", "ssd") for m in ("in_chunk", "forced_break", "split")]
         + [("conv1d", "xla", "in_chunk")]
         + [("gdn", "pallas_triton", "split")]
         + [(op, impl, "in_chunk") for op in ("gdn", "kda", "ssd") for impl in ("pallas_triton", "pallas_mosaic_gpu")]
         + [(op, "sequence_parallel", "in_chunk") for op in ("gdn", "kda")])
# the interpreted kernels and the split method's eager launches take one of these poisons per input in turn (NaN in
# some, inf in the others), all inputs of the row in one call; tests/gpu/test_fuzz_gpu.py poisons the compiled
# kernels on the GPU with all of them
INTERPRETED_POISONS = (np.nan, np.inf)


@functools.cache
def _compiled(bucket, method):
    """The XLA path with traced metadata: one compile serves every poisoned call (eager calls dispatch op by op)."""
    def run(arrays, params, initial_state, cu_seqlens, checkpoint_cu, checkpoint_offsets):
        batch = Batch(bucket, arrays, params, initial_state, None, cu_seqlens, checkpoint_cu, checkpoint_offsets)
        return call(batch, "xla", **({} if bucket.op == "conv1d" else dict(checkpoint_method=method)))
    return jax.jit(run)


def _run(batch, implementation, method, *, arrays=None, initial_state=None):
    arrays = batch.arrays if arrays is None else arrays
    initial_state = batch.initial_state if initial_state is None else initial_state
    if implementation == "xla" and method != "split":
        out = _compiled(batch.bucket, method)(arrays, batch.params, initial_state, batch.cu_seqlens,
                                              batch.checkpoint_cu, batch.checkpoint_offsets)
        return [np.asarray(x, np.float32) for x in out]
    options = {}
    if batch.bucket.op != "conv1d":
        options["checkpoint_method"] = method
    if implementation.startswith("pallas"):
        options["config"] = interpret_config(batch.bucket.op, implementation)
    return [np.asarray(x, np.float32) for x in call(batch, implementation, arrays=arrays,
                                                    initial_state=initial_state, **options)]


def _same(a, b):
    return np.array_equal(a, b, equal_nan=True)


@pytest.mark.parametrize("op,implementation,method", CASES)
def test_poisoned_row_and_padding_leave_the_others_bitwise(op, implementation, method):
    if implementation.startswith("pallas"):
        pytest.importorskip("jax.experimental.pallas")
    mosaic = implementation == "pallas_mosaic_gpu"
    bucket = (MOSAIC_BUCKETS if mosaic else BUCKETS)[op]
    rng = np.random.default_rng(abs(hash((op, implementation, method))) % 2 ** 32)
    batch = random_batch(rng, bucket, lengths=LENGTHS, dtype=jnp.bfloat16 if mosaic else np.float32)
    batch.has_initial_state[:] = True
    batch.initial_state = rng.standard_normal(batch.initial_state.shape).astype(np.float32)
    # rows with checkpoints everywhere, so every row's checkpoint states are compared
    batch.checkpoint_cu = np.array([0, 2, 2, 4], np.int32)
    batch.checkpoint_offsets = np.array([30, 65, 50, 99], np.int32)
    base = _run(batch, implementation, method)
    cu, ccu = batch.cu_seqlens, batch.checkpoint_cu
    interpreted = implementation.startswith("pallas") or method == "split" or implementation == "sequence_parallel"
    poisons = INTERPRETED_POISONS if interpreted else POISONS
    for poisoned in (0,) if interpreted else (0, 2):
        others = [r for r in range(bucket.rows) if r != poisoned]
        tokens = np.concatenate([np.arange(cu[r], cu[r + 1]) for r in others])
        ckpts = np.concatenate([np.arange(ccu[r], ccu[r + 1]) for r in others]).astype(int)
        names = list(batch.arrays) + ["initial_state"]
        # interpreted: one call with every input of the row poisoned at once (any leak still reaches a neighbour as
        # NaN or inf); compiled: one call per input and poison
        poisonings = ([[(name, poisons[n % len(poisons)]) for n, name in enumerate(names)]] if interpreted else
                      [[(name, value)] for name in names for value in poisons])
        for poisoning in poisonings:
            arrays, init = dict(batch.arrays), batch.initial_state.copy()
            for name, value in poisoning:
                if name == "initial_state":
                    init[poisoned] = value
                else:
                    a = np.asarray(arrays[name], np.float32).copy()
                    a[cu[poisoned] + int(rng.integers(cu[poisoned + 1] - cu[poisoned]))] = value
                    arrays[name] = jnp.asarray(a, batch.arrays[name].dtype)
            out = _run(batch, implementation, method, arrays=arrays, initial_state=init)
            where = f"{', '.join(f'{name} = {value}' for name, value in poisoning)} in row {poisoned}"
            assert _same(out[0][tokens], base[0][tokens]), f"outputs of other rows changed: {where}"
            assert _same(out[1][others], base[1][others]), f"final states of other rows changed: {where}"
            assert _same(out[2][ckpts], base[2][ckpts]), f"checkpoints of other rows changed: {where}"
    for value in poisons[:1] if interpreted else poisons:
        arrays = {name: jnp.asarray(np.where(np.arange(bucket.tokens).reshape(-1, *[1] * (a.ndim - 1)) >= cu[-1],
                                             value, np.asarray(a, np.float32)), a.dtype)
                  for name, a in batch.arrays.items()}
        out = _run(batch, implementation, method, arrays=arrays)
        for got, want in zip(out, base):
            assert _same(got[:cu[-1]] if got.shape[0] == bucket.tokens else got,
                         want[:cu[-1]] if want.shape[0] == bucket.tokens else want), f"padding = {value} leaked"


@pytest.mark.parametrize("op", sorted(BUCKETS))
def test_traced_slots_outside_the_pool_are_masked(op):
    """-1 and S (out of range) initial slots read zeros; -1 and S final and checkpoint slots write nothing."""
    bucket = BUCKETS[op]
    rng = np.random.default_rng(7)
    batch = random_batch(rng, bucket, lengths=LENGTHS)
    batch.checkpoint_cu = np.array([0, 1, 1, 2], np.int32)
    batch.checkpoint_offsets = np.array([30, 50, 0, 0], np.int32)
    num_slots = 8
    pool = rng.standard_normal((num_slots, *batch.state_shape)).astype(np.float32)
    slots = dict(initial_state_indices=np.array([-1, num_slots, 3], np.int32),
                 has_initial_state=np.array([True, True, True]),
                 final_state_indices=np.array([-1, num_slots, 4], np.int32),
                 checkpoint_state_indices=np.array([-1, num_slots + 5, 0, 0], np.int32))

    @jax.jit
    def paged(pool, initial, has, final, ckpt):
        return call_paged(batch, "xla", pool, initial_state_indices=initial, has_initial_state=has,
                          final_state_indices=final, checkpoint_state_indices=ckpt)

    _, new_pool = paged(pool, *slots.values())
    new_pool = np.asarray(new_pool)
    untouched = [s for s in range(num_slots) if s != 4]
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])  # -1 did not wrap onto slot S - 1
    fresh = batch.initial_state.copy()
    fresh[:2] = 0
    fresh[2] = pool[3]
    expected = call(batch, "reference", initial_state=fresh)
    np.testing.assert_allclose(new_pool[4], np.asarray(expected[1])[2], rtol=1e-4, atol=1e-5)
