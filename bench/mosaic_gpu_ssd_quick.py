"""Quick H200 timing of the Mosaic GPU SSD (`jaxckpt.ops.ssd.pallas_mosaic_gpu`) beside the Pallas Triton SSD and
jla's Mosaic GPU simple GLA (SSD's core: q = C, k = B, v = delta x, g = delta A) in one run: wall and summed kernel
time per call, per-kernel breakdown, and our output against the Triton SSD's.

Ours runs as users call it: x [T, H, P] with cu_seqlens traced (the gathered chunk-major layout) or batched
[1, T, H, P] (cu_seqlens None: metadata known on the host), an initial state, and optionally one checkpoint at
the row's last 1024-token boundary. `--z on` (or `--z`) passes a random gate z [T, H, P] (bf16) to the SSD calls
(fused into both kernels' outputs), `--z both` times each call without and with it in the same run (labels end in
" z" with it); jla's simple GLA has no gate and runs without it, once per shape. `--stages` times ours at given TMA
ring depths beside the automatic one (`auto`).

    python -m bench.mosaic_gpu_ssd_quick --shapes 8192,128 32768,32 --out r.json
    python -m bench.mosaic_gpu_ssd_quick --shapes 8192,128 --z both --stages auto 3 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import device, jax_time, kernel_times, versions  # noqa: E402
from bench.ops_bench import ssd_inputs  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["8192,128", "32768,32"])
    parser.add_argument("--pieces", nargs="+", default=["auto"])
    parser.add_argument("--z", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                        help="a random gate z [T, H, P] (y * silu(z)): off, on (`--z` alone) or both in one run")
    parser.add_argument("--stages", nargs="+", default=["auto"], help="our TMA ring depths: auto or 2, 3, 4")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxckpt import ops

    rows = []

    def record(label, shape, fn, *fn_args, out=None):
        t = jax_time(fn, *fn_args)
        kernels, device_ms = kernel_times(fn, fn_args, reps=10)
        row = dict(label=label, shape=shape, wall_ms=t["median_ms"], device_ms=device_ms,
                   kernels={k: round(v, 4) for k, v in list(kernels.items())[:8]})
        if out is not None:
            row.update(out)
        rows.append(row)
        print(json.dumps(row), flush=True)

    gates = {"off": (False,), "on": (True,), "both": (False, True)}[args.z]
    ours = [{"pieces": p if p == "auto" else int(p), "stages": None if st == "auto" else int(st)}
            for p in args.pieces for st in args.stages]
    for shape in args.shapes:
        T, H = (int(v) for v in shape.split(","))
        x, dt, A, B, C, h0 = ssd_inputs(T, H, 128, 64)
        bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
        cu = jnp.asarray([0, T], jnp.int32)
        ccu, off = jnp.asarray([0, 1], jnp.int32), jnp.asarray([(T - 1) // 1024 * 1024], jnp.int32)
        for gate in gates:
            z = bf(np.random.default_rng(1).standard_normal(x.shape)) if gate else None
            arrays = (bf(x), bf(dt), jnp.asarray(A), bf(B), bf(C), jnp.asarray(h0), z)
            tag = " z" if gate else ""
            results = {}
            for impl, options in [("pallas_triton", None)] + [("pallas_mosaic_gpu", o) for o in ours]:
                name = impl if options is None else f"{impl}@pieces={options['pieces']}" + (
                    f",stages={options['stages']}" if options["stages"] else "")
                for ckpt in (False, True):
                    f = jax.jit(lambda x, dt, A, B, C, h0, z, cu, ccu, off, impl=impl, options=options, ckpt=ckpt:
                                ops.ssd(x, dt, A, B, C, z=z, initial_state=h0, cu_seqlens=cu,
                                        checkpoint_cu=ccu if ckpt else None, checkpoint_offsets=off if ckpt else None,
                                        implementation=impl, kernel_options=options))
                    out = f(*arrays, cu, ccu, off)
                    results[(name, ckpt)] = out
                    extra = {}
                    if impl != "pallas_triton":
                        ref = results[("pallas_triton", ckpt)]
                        extra = {f"vs_triton_{n}": float(jnp.linalg.norm((a - b).astype(jnp.float32))
                                                         / jnp.linalg.norm(b.astype(jnp.float32)))
                                 for n, a, b in zip(("y", "final", "ckpt"), out, ref) if b.size}
                    record(f"{name} traced_cu ckpt={ckpt}{tag}", shape, f, *arrays, cu, ccu, off, out=extra)
            f = jax.jit(lambda x, dt, A, B, C, h0, z: ops.ssd(x[None], dt[None], A, B[None], C[None],
                                                               z=None if z is None else z[None], initial_state=h0,
                                                               implementation="pallas_mosaic_gpu"))
            record(f"pallas_mosaic_gpu batched{tag}", shape, f, *arrays)
        try:
            from jla.ops import linear_attention

            delta = np.log1p(np.exp(dt))
            v = bf(x * delta[..., None])[None]
            g = jnp.asarray(delta * A)[None]
            q, k = (bf(np.broadcast_to(a, (T, H, 128)))[None] for a in (C, B))
            jla = jax.jit(lambda q, k, v, g, h0: linear_attention("simple_gla", q, k, v, g=g, impl="mosaic_gpu",
                                                                  scale=1.0, initial_state=h0,
                                                                  output_final_state=True))
            record("jla_mosaic_gpu_simple_gla", shape, jla, q, k, v, g, jnp.asarray(np.swapaxes(h0, -1, -2)))
        except ImportError as error:
            print(f"jla unavailable: {error}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(device=device(), versions=versions(), argv=sys.argv, rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()
