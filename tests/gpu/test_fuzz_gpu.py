"""The fuzz and isolation properties on the GPU, for the kernels the CPU interpreter cannot run as compiled: random
batches in fixed shape buckets (`tests/ops/fuzz_cases.py`: lengths 0, 1, chunk multiples +- 1, up to three
checkpoints per row, fresh and continued rows, zero and strong decays, NaN padding) against the float64 reference,
and in each batch one row poisoned with NaN or Inf: the other rows bitwise unchanged.

Run on the GPU machine: `JAXCKPT_GPU_TESTS=1 JAX_PLATFORMS=cuda python -m pytest -q -s tests/gpu/test_fuzz_gpu.py`;
`FUZZ_GPU_BATCHES` sets the batches per bucket (default 45: 540 in all over 12 buckets).
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from tests.ops.fuzz_cases import Bucket, call, errors, random_batch

pytestmark = pytest.mark.gpu

BATCHES = int(os.environ.get("FUZZ_GPU_BATCHES", "45"))
# the bf16 and fp32 classes of the shared vectors (tests/vectors/README.md)
TOLERANCE = {jnp.bfloat16: 6e-3, np.float32: 1e-5}

BUCKETS = [
    ("pallas_mosaic_gpu", jnp.bfloat16, Bucket("gdn", tokens=512, rows=4, checkpoints=8, heads=2, v_heads=2,
                                                key=128, value=128)),
    ("pallas_mosaic_gpu", jnp.bfloat16, Bucket("gdn", tokens=512, rows=6, checkpoints=8, heads=2, v_heads=2,
                                                key=64, value=64)),
    ("pallas_mosaic_gpu", jnp.bfloat16, Bucket("kda", tokens=512, rows=4, checkpoints=8, heads=2, v_heads=2,
                                                key=128, value=128)),
    ("pallas_mosaic_gpu", jnp.bfloat16, Bucket("kda", tokens=512, rows=6, checkpoints=8, heads=2, v_heads=2,
                                                key=64, value=64)),
    ("pallas_mosaic_gpu", jnp.bfloat16, Bucket("ssd", tokens=512, rows=4, checkpoints=8, heads=4, v_heads=1,
                                                key=64, value=128)),
    ("pallas_mosaic_gpu", jnp.bfloat16, Bucket("ssd", tokens=512, rows=6, checkpoints=8, heads=2, v_heads=2,
                                                key=64, value=64)),
    ("pallas_triton", np.float32, Bucket("gdn", tokens=512, rows=4, checkpoints=8, heads=2, v_heads=4,
                                         key=64, value=64)),
    ("pallas_triton", jnp.bfloat16, Bucket("gdn", tokens=512, rows=6, checkpoints=8, heads=2, v_heads=2,
                                           key=128, value=128)),
    ("pallas_triton", np.float32, Bucket("kda", tokens=512, rows=4, checkpoints=8, heads=2, v_heads=2,
                                         key=64, value=64)),
    ("pallas_triton", jnp.bfloat16, Bucket("kda", tokens=512, rows=6, checkpoints=8, heads=2, v_heads=2,
                                           key=128, value=128)),
    ("pallas_triton", np.float32, Bucket("ssd", tokens=512, rows=4, checkpoints=8, heads=4, v_heads=2,
                                         key=64, value=64)),
    ("pallas_triton", jnp.bfloat16, Bucket("ssd", tokens=512, rows=6, checkpoints=8, heads=2, v_heads=1,
                                           key=64, value=128)),
]


def _arrays(batch, dtype):
    return {name: jnp.asarray(a, dtype if name in ("q", "k", "v", "x", "B", "C") else a.dtype)
            for name, a in batch.arrays.items()}


def _run(batch, implementation, arrays):
    return [np.asarray(x, np.float32) for x in call(batch, implementation, arrays=arrays)]


@pytest.mark.parametrize("implementation,dtype,bucket", BUCKETS,
                         ids=[f"{i}-{b.op}-{b.tokens}x{b.key}-{np.dtype(d).name}" for i, d, b in BUCKETS])
def test_random_batches_match_float64_and_isolate_rows(implementation, dtype, bucket):
    rng = np.random.default_rng(hash((implementation, bucket)) % 2 ** 32)
    worst = {}
    for index in range(BATCHES):
        batch = random_batch(rng, bucket)
        arrays = _arrays(batch, dtype)
        # the reference sees the inputs the kernel sees (rounded to 16 bits)
        batch.arrays = {name: np.asarray(a, np.float32) for name, a in arrays.items()}
        expected = [np.asarray(x) for x in call(batch, "reference")]
        got = _run(batch, implementation, arrays)
        found = errors(batch, got, expected)
        for name, value in found.items():
            worst[name] = max(worst.get(name, 0.0), value) if value == value else float("nan")
        assert all(e <= TOLERANCE[dtype] for e in found.values()), (index, found, batch.cu_seqlens,
                                                                     batch.checkpoint_cu)
        cu, ccu = batch.cu_seqlens, batch.checkpoint_cu
        lengths = np.diff(cu)
        if (lengths > 0).sum() < 2:
            continue
        row = int(rng.choice(np.nonzero(lengths)[0]))
        name = str(rng.choice(sorted(arrays)))
        poisoned = np.asarray(arrays[name], np.float32).copy()
        poisoned[int(rng.integers(cu[row], cu[row + 1]))] = rng.choice([np.nan, np.inf])
        out = _run(batch, implementation, {**arrays, name: jnp.asarray(poisoned, arrays[name].dtype)})
        others = [r for r in range(bucket.rows) if r != row]
        tokens = np.concatenate([np.arange(cu[r], cu[r + 1]) for r in others])
        ckpts = np.concatenate([np.arange(ccu[r], ccu[r + 1]) for r in others]).astype(int)
        assert np.array_equal(out[0][tokens], got[0][tokens], equal_nan=True), (index, name, row)
        assert np.array_equal(out[1][others], got[1][others], equal_nan=True), (index, name, row)
        assert np.array_equal(out[2][ckpts], got[2][ckpts], equal_nan=True), (index, name, row)
    print(f"{implementation} {bucket.op} T={bucket.tokens} K={bucket.key} {np.dtype(dtype).name}: {BATCHES} batches, "
          f"worst rel-RMS vs float64 " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
