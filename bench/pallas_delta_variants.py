"""GPU check and timing of the Pallas Triton GDN / KDA kernels (`jaxckpt.ops.{gdn,kda}.pallas_triton`).

Run on a GPU host from the repository root: `python bench/pallas_delta_variants.py`. It
(a) checks accuracy at a real shape (T 8192, H 16, K = V = 128, bf16 q/k/v, fp32 gates and initial states, a few
    checkpoints) against the XLA path run in fp32 at HIGHEST precision, and on a short varlen slice against the float64
    token-by-token reference on the CPU (rel-RMS printed; FLA 0.6.0 lands at 2.5e-3 to 4.4e-3 against float64);
(b) times the kernels (median of RUNS wall-clock runs after block_until_ready, after warm-up) at the anchor shapes
    (B, T, H) = (1, 8192, 16), (1, 32768, 16), (8, 4096, 32) as B equal varlen rows, HV = H, with and without one
    checkpoint per row: version 1 (the run-1 best tuning, the baseline), version 2 and version 2 with `fuse_output`
    side by side on every shape, then a sweep of version 2 tunings on the first shape while time is left.
Inputs follow `shared/anchors/peer_probe.py`: L2-normalised q, k; g = logsigmoid(N(0, 1)) (KDA: / 8); beta =
sigmoid(N(0, 1)); initial states 0.1 N(0, 1). Every case runs in its own try/except; a deadline keeps the whole run
under about 6 minutes. A table goes to stdout and JSON to $OUT/pallas_delta.json when OUT is set.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxckpt.ops.gdn import pallas_triton as gdn_pallas  # noqa: E402
from jaxckpt.ops.gdn import reference as gdn_reference  # noqa: E402
from jaxckpt.ops.gdn import xla as gdn_xla  # noqa: E402
from jaxckpt.ops.kda import pallas_triton as kda_pallas  # noqa: E402
from jaxckpt.ops.kda import reference as kda_reference  # noqa: E402
from jaxckpt.ops.kda import xla as kda_xla  # noqa: E402

HEAD_DIM = 128
RUNS = 15
WARMUP = 2
DEADLINE_S = 330.0
SHAPES = ((1, 8192, 16), (1, 32768, 16), (8, 4096, 32))
# per op: the best version-1 variant of run 1 (the baseline), version 2 and version 2 with the output fused into the
# state pass; each timed on every shape with and without one checkpoint per row
MAIN = {
    "gdn": (dict(version=1, num_warps=4, num_stages=2, block_v=32), dict(block_v=32),
            dict(fuse_output=True, block_v=32)),
    "kda": (dict(version=1, num_warps=8, num_stages=2), dict(block_v=32), dict(fuse_output=True, block_v=32)),
}
# then, time permitting, version 2 tunings on the first shape without checkpoints
SWEEP = (
    dict(block_v=16),
    dict(block_v=64),
    dict(fuse_output=True, block_v=16),
    dict(fuse_output=True, block_v=64),
    dict(block_v=32, num_warps=8),
    dict(block_v=32, intra_num_warps=8),
    dict(fuse_output=True, block_v=32, num_stages=3),
)
ACCURACY_VARIANTS = (dict(), dict(fuse_output=True))
TUNING_LABELS = ("version", "fuse_output", "num_warps", "num_stages", "block_v", "intra_num_warps")
OPS = {"gdn": (gdn_pallas.gated_delta_rule, gdn_xla.gated_delta_rule, gdn_reference.gated_delta_rule),
       "kda": (kda_pallas.kda, kda_xla.kda, kda_reference.kda)}
START = time.perf_counter()


def elapsed():
    return time.perf_counter() - START


def rel_rms(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.sqrt(np.sum((actual - expected) ** 2) / np.sum(expected ** 2)))


def make_inputs(op, num_rows, row_len, heads, *, checkpoints, seed=0, dtype=jnp.bfloat16):
    """Packed inputs of num_rows equal rows; `checkpoints` offsets per row (same for every row)."""
    num_tokens = num_rows * row_len
    keys = jax.random.split(jax.random.key(seed), 6)
    d = HEAD_DIM

    def unit(key):
        x = jax.random.normal(key, (num_tokens, heads, d), jnp.float32)
        return (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(dtype)

    g_shape = (num_tokens, heads, d) if op == "kda" else (num_tokens, heads)
    g = jax.nn.log_sigmoid(jax.random.normal(keys[3], g_shape, jnp.float32)) / (8.0 if op == "kda" else 1.0)
    ckpt = np.asarray(checkpoints, np.int32)
    return dict(q=unit(keys[0]), k=unit(keys[1]), v=jax.random.normal(keys[2], (num_tokens, heads, d), dtype),
                g=g, beta=jax.nn.sigmoid(jax.random.normal(keys[4], (num_tokens, heads), jnp.float32)),
                initial_state=0.1 * jax.random.normal(keys[5], (num_rows, heads, d, d), jnp.float32),
                cu_seqlens=jnp.arange(num_rows + 1, dtype=jnp.int32) * row_len,
                checkpoint_cu=jnp.arange(num_rows + 1, dtype=jnp.int32) * ckpt.size,
                checkpoint_offsets=jnp.asarray(np.tile(ckpt, num_rows)))


def time_call(fn, inputs):
    jax.block_until_ready(fn(**inputs))
    for _ in range(WARMUP - 1):
        jax.block_until_ready(fn(**inputs))
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(**inputs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def check_accuracy(results):
    for op, (pallas_fn, xla_fn, reference_fn) in OPS.items():
        name = f"accuracy {op} T=8192 H=16 bf16 vs xla fp32"
        try:
            inputs = make_inputs(op, 1, 8192, 16, checkpoints=[1, 4096, 5000, 8191], seed=1)
            exact = xla_fn(**{k: v.astype(jnp.float32) if k in ("q", "k", "v") else v for k, v in inputs.items()})
            for variant in ACCURACY_VARIANTS:
                ours = pallas_fn(**inputs, **variant)
                errs = {n: rel_rms(a, e) for n, a, e in zip(("o", "final", "ckpt"), ours, exact)}
                nan = any(bool(jnp.isnan(x).any()) for x in ours)
                results.append(dict(case=name, **variant, **errs, nan=nan))
                print(f"{name} {variant}: " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()) + f" nan={nan}",
                      flush=True)
        except Exception as exc:  # noqa: BLE001 - one failure must not stop the rest
            results.append(dict(case=name, error=repr(exc)[:500]))
            traceback.print_exc()
        name = f"accuracy {op} varlen 700+1+299 H=2 HV=4 bf16 vs float64 reference"
        try:
            inputs = make_inputs(op, 1, 1000, 4, checkpoints=[], seed=2)
            inputs.update(q=inputs["q"][:, :2], k=inputs["k"][:, :2],
                          initial_state=inputs["initial_state"][jnp.array([0, 0, 0])],
                          cu_seqlens=jnp.array([0, 700, 701, 1000], jnp.int32),
                          checkpoint_cu=jnp.array([0, 3, 3, 4], jnp.int32),
                          checkpoint_offsets=jnp.array([1, 64, 333, 298], jnp.int32))
            exact = reference_fn(**{k: np.asarray(v) for k, v in inputs.items()})
            for chunk_size, variant in ((64, ACCURACY_VARIANTS[0]), (32, ACCURACY_VARIANTS[-1])):
                ours = pallas_fn(**inputs, chunk_size=chunk_size, **variant)
                errs = {n: rel_rms(a, e) for n, a, e in zip(("o", "final", "ckpt"), ours, exact)}
                results.append(dict(case=f"{name} C={chunk_size}", **variant, **errs))
                print(f"{name} C={chunk_size} {variant}: " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()),
                      flush=True)
        except Exception as exc:  # noqa: BLE001
            results.append(dict(case=name, error=repr(exc)[:500]))
            traceback.print_exc()


def bench_case(results, op, shape, variant, *, checkpoint, impl="pallas"):
    num_rows, row_len, heads = shape
    label = dict(op=op, impl=impl, B=num_rows, T=row_len, H=heads, checkpoint=checkpoint, **variant)
    if elapsed() > DEADLINE_S:
        results.append(dict(label, error="skipped: deadline"))
        return None
    try:
        inputs = make_inputs(op, num_rows, row_len, heads, checkpoints=[row_len - 512] if checkpoint else [])
        pallas_fn, xla_fn, _ = OPS[op]
        fn = jax.jit(lambda **kw: pallas_fn(**kw, **variant)) if impl == "pallas" else xla_fn
        ms = time_call(fn, inputs)
        results.append(dict(label, ms=ms))
        print(f"{op:4s} {impl:6s} B={num_rows} T={row_len:5d} H={heads} ckpt={int(checkpoint)} {variant}: "
              f"{ms:.3f} ms   [{elapsed():.0f}s]", flush=True)
        return ms
    except Exception as exc:  # noqa: BLE001
        results.append(dict(label, error=repr(exc)[:500]))
        print(f"{op} {shape} {variant} ckpt={checkpoint}: FAILED {exc!r}"[:400], flush=True)
        return None


def main():
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    results = []
    check_accuracy(results)
    for op, variants in MAIN.items():
        for shape in SHAPES:
            for variant in variants:
                for checkpoint in (False, True):
                    bench_case(results, op, shape, variant, checkpoint=checkpoint)
    for op in MAIN:
        for variant in SWEEP:
            bench_case(results, op, SHAPES[0], variant, checkpoint=False)

    print("\nop   impl   B  T      H   ckpt  variant                                                    ms")
    for r in results:
        if "op" in r:
            variant = {k: v for k, v in r.items() if k in TUNING_LABELS}
            ms = f"{r['ms']:.3f}" if "ms" in r else r.get("error", "")[:60]
            print(f"{r['op']:4s} {r['impl']:6s} {r['B']:<2d} {r['T']:<6d} {r['H']:<3d} {int(r['checkpoint']):<5d} "
                  f"{str(variant):58s} {ms}")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "pallas_delta.json").write_text(json.dumps(dict(jax=jax.__version__, device=str(jax.devices()[0]),
                                                                  results=results), indent=1))
    print(f"done in {elapsed():.0f}s", flush=True)


if __name__ == "__main__":
    main()
