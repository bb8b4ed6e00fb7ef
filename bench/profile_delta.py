"""Where the time of jaxckpt's GPU delta-rule and SSD kernels goes: device time per kernel from a profiler trace.

GPU: `python -m bench.profile_delta [--ops gdn kda ssd] [--impl pallas_triton] [--name NAME]` writes
`<name>.json` / `.md` under $OUT, else bench/results. Each case is jitted, warmed, then traced for `--reps` calls
with `jax.profiler` (perfetto JSON); GPU kernel events are summed by name and divided by the number of calls, so
the table reads "ms per call" for each Pallas launch (delta_gate_cumsum, delta_intra, delta_state, delta_output,
the SSD launches) and for the XLA glue around them (the traced chunk layout, casts, the final-state gathers).
Shapes: the anchors' GDN/KDA (1, 8192, 16) and (1, 32768, 16) and SSD (32768, 32), without checkpoints and with
one per row, so the checkpoint cost shows up per kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from bench.common import device, implementation_spec, kernel_times, versions  # noqa: E402
from bench.ops_bench import checkpoint_lists, delta_inputs  # noqa: E402

DELTA_CASES = [[8192], [32768]]
SSD_CASES = [(32768, 32)]


def delta_case(kind, lengths, mode, impl):
    import jax
    import jax.numpy as jnp

    from jaxckpt import ops

    fn = ops.gated_delta_rule if kind == "gdn" else ops.kda
    impl, kernel_options = implementation_spec(impl)
    q, k, v, g, beta, h0, cu = delta_inputs(lengths, 16, 128, kind)
    ccu, offsets = checkpoint_lists(lengths, mode)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    f = jax.jit(lambda q, k, v, g, beta, h0, cu, ccu, off: fn(
        q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=off,
        implementation=impl, kernel_options=kernel_options))
    args = (bf(q), bf(k), bf(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(h0), jnp.asarray(cu),
            jnp.asarray(ccu), jnp.asarray(offsets))
    return f, args


def ssd_case(T, H, mode, impl):
    import jax
    import jax.numpy as jnp

    from jaxckpt import ops

    impl, kernel_options = implementation_spec(impl)
    rng = np.random.default_rng(0)
    P, N = 64, 128
    x = jnp.asarray(rng.standard_normal((T, H, P)), jnp.bfloat16)
    dt = jnp.asarray(rng.standard_normal((T, H)) - 1, jnp.float32)
    A = jnp.asarray(-np.exp(rng.standard_normal(H)), jnp.float32)
    B = jnp.asarray(rng.standard_normal((T, 1, N)) / np.sqrt(N), jnp.bfloat16)
    C = jnp.asarray(rng.standard_normal((T, 1, N)) / np.sqrt(N), jnp.bfloat16)
    h0 = jnp.zeros((1, H, P, N), jnp.float32)
    ccu, offsets = checkpoint_lists([T], mode)
    f = jax.jit(lambda x, dt, A, B, C, h0, cu, ccu, off: ops.ssd(
        x, dt, A, B, C, initial_state=h0, cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=off,
        implementation=impl, kernel_options=kernel_options))
    return f, (x, dt, A, B, C, h0, jnp.asarray([0, T], jnp.int32), jnp.asarray(ccu), jnp.asarray(offsets))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", default=["gdn", "kda", "ssd"])
    parser.add_argument("--impl", default="pallas_triton")
    parser.add_argument("--modes", nargs="+", default=["none", "per_row"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--name", default="profile_delta")
    args = parser.parse_args(argv)
    out_dir = Path(os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    rows = []
    cases = [(op, {"T": sum(lengths), "H": 16, "K": 128, "V": 128}, lambda m, op=op, lengths=lengths:
              delta_case(op, lengths, m, args.impl)) for op in args.ops if op in ("gdn", "kda")
             for lengths in DELTA_CASES]
    if "ssd" in args.ops:
        cases += [("ssd", {"T": T, "H": H, "P": 64, "N": 128}, lambda m, T=T, H=H: ssd_case(T, H, m, args.impl))
                  for T, H in SSD_CASES]
    for op, shape, build in cases:
        for mode in args.modes:
            try:
                kernels, total = kernel_times(*build(mode), reps=args.reps)
                rows.append({"op": op, "shape": shape, "checkpoints": mode, "kernel_ms": kernels,
                             "total_kernel_ms": total})
                top = ", ".join(f"{name[:40]} {ms:.3f}" for name, ms in list(kernels.items())[:6])
                print(f"{op} {shape} {mode}: total {total:.3f} ms | {top}", flush=True)
            except Exception as error:  # noqa: BLE001 - record the failure and go on
                traceback.print_exc()
                rows.append({"op": op, "shape": shape, "checkpoints": mode, "error": f"{type(error).__name__}: "
                                                                                  f"{str(error)[:300]}"})
            write(out_dir, args, rows)


def write(out_dir: Path, args, rows):
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"schema": 1, "name": args.name, "device": device(), "versions": versions(),
               "command": f"python -m bench.profile_delta --ops {' '.join(args.ops)} --impl {args.impl}",
               "results": rows}
    (out_dir / f"{args.name}.json").write_text(json.dumps(payload, indent=1))
    lines = [f"# {args.name}", "", f"device: {payload['device']}", f"versions: {payload['versions']}",
             f"command: `{payload['command']}`", "", "| op | shape | checkpoints | kernel | ms per call |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {json.dumps(r['shape'])} | {r['checkpoints']} | FAIL | {r['error']} |")
            continue
        lines.append(f"| {r['op']} | {json.dumps(r['shape'])} | {r['checkpoints']} | **all kernels** | "
                     f"{r['total_kernel_ms']:.3f} |")
        for name, ms in r["kernel_ms"].items():
            if ms >= 0.005:
                lines.append(f"| | | | {name[:80]} | {ms:.3f} |")
    (out_dir / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
