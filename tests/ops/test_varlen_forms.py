"""The three input forms of every public entry: packed `[T, ...]` with `cu_seqlens`, `[1, T, ...]` with `cu_seqlens`
(FLA's, FlashQLA's and vLLM's varlen convention) and dense `[B, T, ...]`: the same rows give the same answers."""

import numpy as np
import pytest

from tests.ops.fuzz_cases import Bucket, call, random_batch

BUCKETS = {
    "gdn": Bucket("gdn", tokens=48, rows=3, checkpoints=3, heads=2, v_heads=4, key=16, value=16),
    "kda": Bucket("kda", tokens=48, rows=3, checkpoints=3, heads=2, v_heads=2, key=16, value=16),
    "ssd": Bucket("ssd", tokens=48, rows=3, checkpoints=3, heads=2, v_heads=1, key=16, value=32),
    "conv1d": Bucket("conv1d", tokens=48, rows=3, checkpoints=3, heads=8, key=4),
}


@pytest.mark.parametrize("op", sorted(BUCKETS))
def test_leading_one_with_cu_seqlens_equals_packed(op):
    batch = random_batch(np.random.default_rng(), BUCKETS[op])
    packed = [np.asarray(x) for x in call(batch, "xla")]
    out, final, ckpt = (np.asarray(x) for x in call(batch, "xla", arrays={n: a[None] for n, a in batch.arrays.items()}))
    assert out.shape == (1, *packed[0].shape)
    np.testing.assert_array_equal(out[0], packed[0])
    np.testing.assert_array_equal(final, packed[1])
    np.testing.assert_array_equal(ckpt, packed[2])


@pytest.mark.parametrize("op", sorted(BUCKETS))
def test_batch_above_one_with_cu_seqlens_names_cu_seqlens(op):
    batch = random_batch(np.random.default_rng(), BUCKETS[op])
    twice = {n: np.stack([a, a]) for n, a in batch.arrays.items()}
    with pytest.raises(ValueError, match="cu_seqlens: .*B must be 1"):
        call(batch, "xla", arrays=twice)
