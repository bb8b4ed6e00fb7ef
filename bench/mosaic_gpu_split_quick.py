"""The sequence split of the Mosaic GPU state pass (`pallas_mosaic_gpu_split`): wall and device time per kernel of
the version 1 state pass against the lanes kernel with 1, 2, 4, 8 and "auto" pieces, on one Hopper GPU.

GPU: `python -m bench.mosaic_gpu_split_quick [--op gdn kda] [--rows 1] [--tokens 8192 32768] [--heads 16]
[--pieces 1 2 4 8 auto] [--intra mosaic_gpu] [--checkpoints 0]`.
Per shape (rows of T tokens each, H = HV heads, K = V = 128, bf16 q, k, v, l2-normalized in the op, an fp32 initial
state per row, as the anchors), each variant is the jitted op entry (`jaxckpt.ops.<op>.pallas_mosaic_gpu`) with
`intra` and its state options. Printed per variant (`print_variants`, `bench.common.time_call`): the median wall ms,
the summed device ms per call and the device ms of each kernel (a profiler trace of `--reps` calls: the state passes
show as delta_state_mosaic (v1), delta_state_lanes_map and delta_state_lanes (v2)), and the rel-RMS of o, final
state and checkpoints against state v1. `choose_pieces`' pick for the shape is printed first.
`--interpret` is a CPU dry run of this script at tiny sizes (e.g. `--tokens 256 --heads 2 --dim 64 --pieces 1 2`),
not a measurement (no device times there).
"""

from __future__ import annotations

import argparse
import os
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from bench.common import rel_rms, time_call  # noqa: E402


def make_inputs(rng, op, num_tokens, heads, dim, rows):
    import jax.numpy as jnp

    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    g_shape = (num_tokens, heads, dim) if op == "kda" else (num_tokens, heads)
    g = -np.log1p(np.exp(-rng.standard_normal(g_shape))) / (8 if op == "kda" else 1)
    arrays = dict(q=unit(rng.normal(size=(num_tokens, heads, dim))), k=unit(rng.normal(size=(num_tokens, heads, dim))),
                  v=rng.normal(size=(num_tokens, heads, dim)), g=g,
                  beta=1 / (1 + np.exp(-rng.standard_normal((num_tokens, heads)))),
                  initial_state=0.1 * rng.standard_normal((rows, heads, dim, dim)))
    return {name: jnp.asarray(x, jnp.bfloat16 if name in "qkv" else jnp.float32) for name, x in arrays.items()}


def errors(actual, expected) -> str:
    return "rel-RMS vs v1: " + ", ".join(f"{name} {rel_rms(a, b):.1e}"
                                         for name, a, b in zip(("o", "final", "ckpt"), actual, expected) if np.size(b))


def checkpoint_meta(rows, length, num_checkpoints):
    """checkpoint_cu, checkpoint_offsets of `num_checkpoints` evenly spaced offsets per row (none for 0)."""
    import jax.numpy as jnp

    if not num_checkpoints:
        return {}
    offsets = np.unique(np.clip(np.linspace(0, length, num_checkpoints + 2)[1:-1].astype(np.int32), 1, length - 1))
    return dict(checkpoint_cu=jnp.arange(rows + 1, dtype=jnp.int32) * offsets.size,
                checkpoint_offsets=jnp.asarray(np.tile(offsets, rows)))


def print_variants(label, fns, arrays, *, reps):
    """Times each jitted variant (`bench.common.time_call`, `reps` calls traced) and prints its wall and device ms,
    the rel-RMS against the first variant that ran, then each kernel's device ms."""
    baseline = None
    for name, fn in fns.items():
        try:
            out, wall, kernels, device_ms = time_call(fn, arrays, trace_reps=reps)
        except Exception:  # noqa: BLE001 - one failing variant must not hide the others' times
            traceback.print_exc()
            print(f"{label} {name:16s} FAILED", flush=True)
            continue
        baseline = out if baseline is None else baseline
        note = "" if out is baseline else "  " + errors(out, baseline)
        print(f"{label} {name:16s} wall {wall:8.3f} ms  device {device_ms:8.3f} ms{note}", flush=True)
        for kernel, ms in kernels.items():
            print(f"    {ms:8.3f} ms  {kernel}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", nargs="+", default=["gdn"], choices=["gdn", "kda"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="tokens per row")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--pieces", nargs="+", default=["1", "2", "4", "8", "auto"])
    parser.add_argument("--intra", default="mosaic_gpu", choices=["pallas_triton", "mosaic_gpu"])
    parser.add_argument("--checkpoints", type=int, default=0, help="per row, evenly spaced")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--interpret", action="store_true")
    args = parser.parse_args(argv)

    import functools

    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.common.pallas_mosaic_gpu_split import choose_pieces
    from jaxckpt.ops.gdn import pallas_mosaic_gpu as gdn_mosaic
    from jaxckpt.ops.kda import pallas_mosaic_gpu as kda_mosaic

    print(f"devices: {jax.devices()}")
    entries = {"gdn": gdn_mosaic.gated_delta_rule, "kda": kda_mosaic.kda}
    variants = {"v1": {"state": "v1"}}
    variants.update({f"v2 pieces={p}": {"state": "v2", "pieces": p if p == "auto" else int(p)} for p in args.pieces})
    rng = np.random.default_rng(0)
    for op in args.op:
        for rows in args.rows:
            for length in args.tokens:
                T = rows * length
                inputs = make_inputs(rng, op, T, args.heads, args.dim, rows)
                meta = dict(cu_seqlens=jnp.arange(rows + 1, dtype=jnp.int32) * length, interpret=args.interpret,
                            use_qk_l2norm=True, intra=args.intra, **checkpoint_meta(rows, length, args.checkpoints))
                arrays = [inputs[name] for name in ("q", "k", "v", "g", "beta", "initial_state")]
                label = (f"{op} ({rows}, {length}, {args.heads}) K=V={args.dim} intra={args.intra} "
                         f"ckpts/row={args.checkpoints}")
                auto = choose_pieces(rows, args.heads, args.dim, T, head_k=args.dim)
                print(f"== {label}: choose_pieces -> {auto}", flush=True)
                fns = {name: jax.jit(functools.partial(
                    lambda q, k, v, g, beta, h0, entry, options: entry(q, k, v, g, beta, initial_state=h0, **meta,
                                                                       **options),
                    entry=entries[op], options=options)) for name, options in variants.items()}
                print_variants(label, fns, arrays, reps=args.reps)


if __name__ == "__main__":
    main()
