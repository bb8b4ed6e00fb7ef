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

`python bench/pallas_delta_variants.py --kda-intra` runs only the comparison of KDA's intra-pass variants
(`kda_intra` "resident" = the previous version-2 kernel, "split" = the new default, "streamed"; see
`jaxckpt/ops/common/pallas_triton_delta.py`), in one call of under 9 minutes: (a) their accuracy at T 8192, H 16
bf16 against the XLA path in fp32 (and NaN/inf), (b) per variant and anchor shape, without checkpoints, the wall
time of the jitted op and the device time of the intra launches and of all kernels from a profiler trace, (c) the
accuracy of every variant on the short varlen slice against the float64 reference, (d) while time is left, tunings
of split and streamed (intra_num_warps, kda_block_k, kda_diag) and one checkpoint per row, on the first shape.
JSON to $OUT/pallas_kda_intra.json.

`python bench/pallas_delta_variants.py --ptxas [--op kda] [--tuning '{"kda_intra": "resident"}']` needs no GPU: it
lowers the op for CUDA (H200) on the CPU, compiles every Pallas kernel with the pip `triton` package for sm_90a and
prints ptxas' registers and spill bytes per thread (T 8192, H 16, K = V = 128, bf16). XLA's bundled Triton may
allocate a little differently; it is a check for spills, not a timing.
"""

from __future__ import annotations

import argparse
import json
import math
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
# state pass (KDA: with its default intra pass, `kda_intra="split"`; runs 1-2 had "resident"); each timed on every
# shape with and without one checkpoint per row
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
# --kda-intra: the previous version-2 intra kernel against the new ones (block_v = 32: run 2's best state pass)
KDA_INTRA_VARIANTS = {"resident": dict(kda_intra="resident", block_v=32), "split": dict(kda_intra="split", block_v=32),
                      "streamed": dict(kda_intra="streamed", block_v=32)}
KDA_INTRA_SWEEP = (
    dict(kda_intra="split", block_v=32, intra_num_warps=2),
    dict(kda_intra="split", block_v=32, intra_num_warps=8),
    dict(kda_intra="split", block_v=32, kda_block_k=64),
    dict(kda_intra="split", block_v=32, kda_diag="pairs"),
    dict(kda_intra="streamed", block_v=32, intra_num_warps=2),
    dict(kda_intra="streamed", block_v=32, intra_num_warps=8),
    dict(kda_intra="streamed", block_v=32, kda_diag="pairs"),
    dict(kda_intra="split", block_v=32, intra_num_warps=1),
    dict(kda_intra="split", block_v=32, fuse_output=True),
)
KDA_INTRA_DEADLINE_S = 480.0
TUNING_LABELS = ("version", "fuse_output", "num_warps", "num_stages", "block_v", "intra_num_warps", "kda_intra",
                 "kda_diag", "kda_block_k")
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


def kernel_ms(fn, inputs, reps=5):
    """Device ms per call by kernel name, from a profiler trace (`bench.profile_delta.kernel_times`)."""
    from bench.profile_delta import kernel_times

    per_kernel, total = kernel_times(lambda: fn(**inputs), (), reps=reps)
    intra = sum(ms for name, ms in per_kernel.items() if name.startswith("delta_intra"))
    return dict(intra_ms=intra, kernels_ms=total, per_kernel={k: round(v, 4) for k, v in per_kernel.items()})


def kda_intra_case(results, shape, name, variant, *, checkpoint=False):
    num_rows, row_len, heads = shape
    label = dict(op="kda", impl="pallas", variant=name, B=num_rows, T=row_len, H=heads, checkpoint=checkpoint,
                 **variant)
    if elapsed() > KDA_INTRA_DEADLINE_S:
        results.append(dict(label, error="skipped: deadline"))
        print(f"{name} {shape} {variant}: skipped (deadline)", flush=True)
        return
    try:
        inputs = make_inputs("kda", num_rows, row_len, heads, checkpoints=[row_len - 512] if checkpoint else [])
        fn = jax.jit(lambda **kw: kda_pallas.kda(**kw, **variant))
        row = dict(label, ms=time_call(fn, inputs))
        try:
            row.update(kernel_ms(fn, inputs))
        except Exception as exc:  # noqa: BLE001 - the wall time stands without the trace
            row["trace_error"] = repr(exc)[:300]
        results.append(row)
        print(f"kda {name:9s} B={num_rows} T={row_len:5d} H={heads} ckpt={int(checkpoint)} {variant}: wall "
              f"{row['ms']:.3f} ms, intra {row.get('intra_ms', math.nan):.3f} ms, kernels "
              f"{row.get('kernels_ms', math.nan):.3f} ms   [{elapsed():.0f}s]", flush=True)
    except Exception as exc:  # noqa: BLE001 - one failure must not stop the rest
        results.append(dict(label, error=repr(exc)[:500]))
        print(f"kda {name} {shape} {variant}: FAILED {exc!r}"[:400], flush=True)
        traceback.print_exc()


def kda_intra_accuracy(results, *, varlen):
    """Every intra variant against the XLA path in fp32 (T 8192) or the float64 reference (`varlen` slice)."""
    _, xla_fn, reference_fn = OPS["kda"]
    try:
        if varlen:
            inputs = make_inputs("kda", 1, 1000, 4, checkpoints=[], seed=2)
            inputs.update(q=inputs["q"][:, :2], k=inputs["k"][:, :2],
                          initial_state=inputs["initial_state"][jnp.array([0, 0, 0])],
                          cu_seqlens=jnp.array([0, 700, 701, 1000], jnp.int32),
                          checkpoint_cu=jnp.array([0, 3, 3, 4], jnp.int32),
                          checkpoint_offsets=jnp.array([16, 64, 333, 298], jnp.int32))
            exact = reference_fn(**{k: np.asarray(v) for k, v in inputs.items()})
            case = "kda varlen 700+1+299 H=2 HV=4 bf16 vs float64 reference"
        else:
            inputs = make_inputs("kda", 1, 8192, 16, checkpoints=[1, 16, 4096, 5000, 8191], seed=1)
            exact = xla_fn(**{k: v.astype(jnp.float32) if k in ("q", "k", "v") else v for k, v in inputs.items()})
            case = "kda T=8192 H=16 bf16 vs xla fp32"
    except Exception as exc:  # noqa: BLE001
        results.append(dict(case=f"kda accuracy varlen={varlen}", error=repr(exc)[:500]))
        traceback.print_exc()
        return
    for name, variant in KDA_INTRA_VARIANTS.items():
        if elapsed() > KDA_INTRA_DEADLINE_S:
            results.append(dict(case=case, variant=name, error="skipped: deadline"))
            continue
        try:
            ours = kda_pallas.kda(**inputs, **variant)
            errs = {n: rel_rms(a, e) for n, a, e in zip(("o", "final", "ckpt"), ours, exact)}
            finite = all(bool(jnp.isfinite(x).all()) for x in ours)
            results.append(dict(case=case, variant=name, **variant, **errs, finite=finite))
            print(f"{case} [{name}]: " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()) + f" finite={finite}"
                  f"   [{elapsed():.0f}s]", flush=True)
        except Exception as exc:  # noqa: BLE001
            results.append(dict(case=case, variant=name, error=repr(exc)[:500]))
            traceback.print_exc()


def kda_intra_main():
    print(f"jax {jax.__version__}, devices {jax.devices()}; KDA intra variants {list(KDA_INTRA_VARIANTS)}", flush=True)
    results = []
    kda_intra_accuracy(results, varlen=False)
    for shape in SHAPES:
        for name, variant in KDA_INTRA_VARIANTS.items():
            kda_intra_case(results, shape, name, variant)
    kda_intra_accuracy(results, varlen=True)
    kda_intra_case(results, SHAPES[0], "split", KDA_INTRA_VARIANTS["split"], checkpoint=True)
    for variant in KDA_INTRA_SWEEP:
        kda_intra_case(results, SHAPES[0], variant["kda_intra"], variant)

    timed = [r for r in results if "ms" in r]
    print("\nKDA intra variants, no checkpoints (wall ms of the jitted op / device ms of the intra launches / all "
          "kernels; x = resident's intra time over this one's)")
    for shape in SHAPES:
        base = next((r for r in timed if (r["B"], r["T"], r["H"]) == shape and r["variant"] == "resident"
                     and not r["checkpoint"]), None)
        cells = []
        for name, variant in KDA_INTRA_VARIANTS.items():
            r = next((r for r in timed if (r["B"], r["T"], r["H"]) == shape and r["variant"] == name
                      and not r["checkpoint"] and {k: r.get(k) for k in variant} == variant
                      and not set(r) & {"intra_num_warps", "kda_block_k", "kda_diag", "fuse_output"}), None)
            if r is None:
                cells.append(f"{name} -")
                continue
            speedup = base["intra_ms"] / r["intra_ms"] if base and r.get("intra_ms") else math.nan
            cells.append(f"{name} {r['ms']:.3f} / {r.get('intra_ms', math.nan):.3f} / "
                         f"{r.get('kernels_ms', math.nan):.3f} ({speedup:.1f}x)")
        print(f"  {shape}: " + " | ".join(cells))
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "pallas_kda_intra.json").write_text(json.dumps(dict(jax=jax.__version__,
                                                                      device=str(jax.devices()[0]),
                                                                      results=results), indent=1))
    print(f"done in {elapsed():.0f}s", flush=True)


def ptxas_main(op, tuning, *, num_tokens=8192, heads=16):
    """Registers and spills of every Pallas kernel of `op` with `tuning`, compiled offline for sm_90a (no GPU)."""
    import re
    import subprocess
    import tempfile

    import triton
    from jax._src.pallas.triton import gpu_info, lowering, pallas_call_registration
    from triton.backends.compiler import GPUTarget

    from jaxckpt.ops.common import pallas_triton_delta

    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: h200  # lower for CUDA on a CPU-only host
    kernels = {}
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, grid_mapping, platform, compute_capability, mlir_ctx):
        result = lower(jaxpr, grid_mapping, platform, compute_capability, mlir_ctx)
        kernels[jaxpr.debug_info.func_name] = result.module.operation.get_asm(enable_debug_info=False)
        return result

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
    channel = op == "kda"
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (bf16(num_tokens, heads, HEAD_DIM), bf16(num_tokens, heads, HEAD_DIM), bf16(num_tokens, heads, HEAD_DIM),
            f32(num_tokens, heads, *((HEAD_DIM,) if channel else ())), f32(num_tokens, heads))
    fn = jax.jit(lambda q, k, v, g, beta: pallas_triton_delta.delta_rule(q, k, v, g, beta, per_channel_decay=channel,
                                                                        **tuning))
    jax.export.export(fn, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    warps = {"delta_state": tuning.get("num_warps", 4), "delta_output": tuning.get("num_warps", 4)}
    print(f"{op} {tuning}: T {num_tokens}, H {heads}, K = V = {HEAD_DIM}, bf16, sm_90a via pip triton "
          f"{triton.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, ir in kernels.items():
            num_warps = warps.get(name, tuning.get("intra_num_warps", 4))
            path = Path(tmp, f"{name}.ttir")
            path.write_text(ir)
            try:
                compiled = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                                          options=dict(num_warps=num_warps, num_stages=tuning.get("num_stages", 2)))
                Path(tmp, f"{name}.ptx").write_text(compiled.asm["ptx"])
                report = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(Path(tmp, f"{name}.ptx")),
                                         "-o", os.devnull], capture_output=True, text=True).stderr
                registers = re.search(r"Used (\d+) registers", report)
                spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
                print(f"  {name:20s} warps {num_warps}: {registers.group(1) if registers else '?'} registers, spill "
                      f"stores / loads {spills.group(1) if spills else '?'} / {spills.group(2) if spills else '?'} "
                      f"bytes per thread, shared {compiled.metadata.shared} bytes", flush=True)
            except Exception as exc:  # noqa: BLE001 - report the kernel and go on
                print(f"  {name}: compile failed: {exc!r}"[:300], flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kda-intra", action="store_true", help="only compare KDA's intra-pass variants")
    parser.add_argument("--ptxas", action="store_true", help="registers and spills per kernel, offline (no GPU)")
    parser.add_argument("--op", choices=("gdn", "kda"), default="kda", help="--ptxas: which op")
    parser.add_argument("--tuning", default="{}", help="--ptxas: tuning options as JSON")
    parsed = parser.parse_args()
    if parsed.ptxas:
        ptxas_main(parsed.op, json.loads(parsed.tuning))
        return
    if parsed.kda_intra:
        kda_intra_main()
        return
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
