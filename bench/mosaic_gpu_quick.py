"""GDN (and KDA) with the Mosaic GPU state pass (`implementation="pallas_mosaic_gpu"`) against the Pallas Triton
pipeline, on one Hopper GPU.

GPU: `python -m bench.mosaic_gpu_quick [--tokens 8192 32768] [--heads 16] [--op gdn kda] [--checkpoints 8]`.
Per shape (one row of T tokens, H = HV heads, K = V = 128, bf16 q, k, v, l2-normalized in the op), each
implementation is the jitted op module entry (`jaxckpt.ops.<op>.<impl>`), timed by `bench.common.time_call` (median
wall time of 20 device-synced calls after warmup; compile excluded). Printed per implementation: ms, and the
rel-RMS and max relative error (max |a - b| / max |b|) of o, final state and checkpoints against "pallas_triton"
(default tuning: four launches, TF32 for the state-feeding dots). "pallas_triton@fuse" is the Triton pipeline with
its fused state-and-output pass, the closest like-for-like of the Mosaic GPU kernel.
`--checkpoints n` puts n checkpoints at evenly spaced offsets (chunk boundaries and inside chunks); `--interpret`
is a CPU dry run of this script at tiny sizes (e.g. `--tokens 130 --dim 64 --heads 1`), not a measurement.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from bench.common import max_rel, rel_rms, time_call  # noqa: E402


def make_inputs(rng, op, num_tokens, heads, dim):
    import jax.numpy as jnp

    g_shape = (num_tokens, heads, dim) if op == "kda" else (num_tokens, heads)
    g = -rng.exponential(0.3 / (8 if op == "kda" else 1), size=g_shape)
    arrays = dict(q=rng.normal(size=(num_tokens, heads, dim)), k=rng.normal(size=(num_tokens, heads, dim)),
                  v=rng.normal(size=(num_tokens, heads, dim)), g=g, beta=rng.uniform(0.05, 0.95, (num_tokens, heads)))
    return {name: jnp.asarray(x, jnp.bfloat16 if name in "qkv" else jnp.float32) for name, x in arrays.items()}


def errors(actual, expected) -> str:
    return "; ".join(f"{name} rel-RMS {rel_rms(a, b):.1e} max-rel {max_rel(a, b):.1e}"
                     for name, a, b in zip(("o", "final", "ckpt"), actual, expected) if np.size(b))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--op", nargs="+", default=["gdn"], choices=["gdn", "kda"])
    parser.add_argument("--checkpoints", type=int, default=0)
    parser.add_argument("--interpret", action="store_true")
    args = parser.parse_args(argv)

    import functools

    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.gdn import pallas_mosaic_gpu as gdn_mosaic
    from jaxckpt.ops.gdn import pallas_triton as gdn_triton
    from jaxckpt.ops.kda import pallas_mosaic_gpu as kda_mosaic
    from jaxckpt.ops.kda import pallas_triton as kda_triton

    print(f"devices: {jax.devices()}")
    entries = {"gdn": (gdn_triton.gated_delta_rule, gdn_mosaic.gated_delta_rule),
               "kda": (kda_triton.kda, kda_mosaic.kda)}
    rng = np.random.default_rng(0)
    for op in args.op:
        triton, mosaic = entries[op]
        for T in args.tokens:
            inputs = make_inputs(rng, op, T, args.heads, args.dim)
            meta = dict(cu_seqlens=jnp.array([0, T], jnp.int32), interpret=args.interpret)
            if args.checkpoints:
                offsets = np.linspace(0, T, args.checkpoints + 2)[1:-1].astype(np.int32)
                offsets[::2] = offsets[::2] // 64 * 64  # every other one on a chunk boundary
                offsets = np.unique(np.clip(offsets, 1, T - 1)).astype(np.int32)
                meta.update(checkpoint_cu=jnp.array([0, offsets.size], jnp.int32),
                            checkpoint_offsets=jnp.asarray(offsets))
            runs = {"pallas_triton": functools.partial(triton, use_qk_l2norm=True, **meta),
                    "pallas_triton@fuse": functools.partial(triton, use_qk_l2norm=True, fuse_output=True, **meta),
                    "pallas_mosaic_gpu@state=v1,intra=pallas_triton": functools.partial(
                        mosaic, use_qk_l2norm=True, state="v1", intra="pallas_triton", **meta),
                    "pallas_mosaic_gpu (defaults)": functools.partial(mosaic, use_qk_l2norm=True, **meta)}
            arrays = [inputs[name] for name in ("q", "k", "v", "g", "beta")]
            baseline = None
            for name, fn in runs.items():
                timed = time_call(fn, arrays, trace_reps=0)
                if baseline is None:
                    baseline = timed.out
                note = "" if fn is runs["pallas_triton"] else "  vs pallas_triton: " + errors(timed.out, baseline)
                print(f"{op} (1, {T}, {args.heads}) K=V={args.dim} bf16 ckpts={args.checkpoints} {name:20s} "
                      f"{timed.wall_ms:8.3f} ms{note}", flush=True)


if __name__ == "__main__":
    main()
