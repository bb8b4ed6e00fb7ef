"""Version 1 vs version 2 of the Mosaic GPU state pass on the same intermediates, on one Hopper GPU.

GPU: `python -m bench.mosaic_gpu_state_quick [--shapes 1x8192x16 1x32768x16 8x4096x32] [--op gdn kda]
[--checkpoints 0 8] [--variants publish_slots=1] [--reps 20]`. Per shape B x T x H (B rows of T tokens, H = HV
heads, K = V = 128, bf16, l2-normalized q, k, initial states), `pallas_triton_delta.prepare` + `intra_v2` run
once; then, on their outputs, each of `pallas_mosaic_gpu_delta.state_pass` (v1),
`pallas_mosaic_gpu_state.state_pass_v2` (v2) and the map_mode pass (`state_lanes(..., map_mode=True)` over the
same lanes, the sequence split's first pass) is jitted and timed by `bench.common.time_call`: wall = median of
device-synced calls (compile excluded); device = the kernels of one call from a profiler trace (total, then the
state kernels by name). `--variants`: tunings of `state_pass_v2` timed too ("stages=3,publish_slots=1" is one
variant; `pallas_mosaic_gpu_state`'s docstring). Printed for v2: max relative difference (max |a - b| / max |b|)
against v1 of o (real tokens), final states and checkpoints. `--interpret` is a CPU dry run at tiny sizes (e.g.
`--shapes 1x130x1 --dim 64 --reps 1`), not a measurement.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from bench.common import implementation_spec, max_rel, time_call  # noqa: E402


def intermediates(rng, op, batch, tokens, heads, dim, num_checkpoints, interpret):
    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.common import pallas_triton_delta as triton_delta

    T = batch * tokens
    g_shape = (T, heads, dim) if op == "kda" else (T, heads)
    x = dict(q=rng.normal(size=(T, heads, dim)), k=rng.normal(size=(T, heads, dim)),
             v=rng.normal(size=(T, heads, dim)), g=-rng.exponential(0.3 / (8 if op == "kda" else 1), size=g_shape),
             beta=rng.uniform(0.05, 0.95, (T, heads)))
    x = {name: jnp.asarray(a, jnp.bfloat16 if name in "qkv" else jnp.float32) for name, a in x.items()}
    offsets = np.linspace(0, tokens, num_checkpoints + 2)[1:-1].astype(np.int32)
    offsets[::2] = offsets[::2] // 64 * 64  # every other one on a chunk boundary
    offsets = np.unique(np.clip(offsets, 1, tokens - 1)).astype(np.int32) if num_checkpoints else offsets[:0]
    cu = np.arange(batch + 1, dtype=np.int32) * tokens
    ck_cu = np.arange(batch + 1, dtype=np.int32) * offsets.size
    channel = op == "kda"

    @jax.jit
    def prepare(q, k, v, g, beta):
        p = triton_delta.prepare(q, k, v, g, beta, per_channel_decay=channel, scale=None, use_qk_l2norm=True,
                                 cu_seqlens=jnp.asarray(cu), checkpoint_cu=jnp.asarray(ck_cu),
                                 checkpoint_offsets=jnp.asarray(np.tile(offsets, batch)), chunk_size=64,
                                 interpret=interpret)
        tiles = triton_delta.intra_v2(p, per_channel_decay=channel, chunk_size=64, interpret=interpret)
        return p._replace(io_dtype=None, scale=None), tiles  # arrays only: `jit` returns no dtypes

    p, tiles = jax.block_until_ready(prepare(*(x[name] for name in ("q", "k", "v", "g", "beta"))))
    p = p._replace(io_dtype=jnp.dtype(jnp.bfloat16), scale=dim ** -0.5)
    init = jnp.asarray(0.1 * rng.normal(size=(batch, heads, dim, dim)), jnp.float32)
    return p, tiles, init


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1x8192x16", "1x32768x16", "8x4096x32"])
    parser.add_argument("--op", nargs="+", default=["gdn", "kda"], choices=["gdn", "kda"])
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[0, 8])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--variants", nargs="*", default=["publish_slots=1"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--interpret", action="store_true")
    args = parser.parse_args(argv)

    import functools

    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.common import pallas_mosaic_gpu_delta as mgd
    from jaxckpt.ops.common import pallas_mosaic_gpu_state as mgs

    print(f"devices: {jax.devices()}", flush=True)
    rng = np.random.default_rng(0)
    for op in args.op:
        channel = op == "kda"
        for shape in args.shapes:
            batch, tokens, heads = (int(n) for n in shape.split("x"))
            for num_ckpt in args.checkpoints:
                p, tiles, init = intermediates(rng, op, batch, tokens, heads, args.dim, num_ckpt, args.interpret)
                options = dict(per_channel_decay=channel, interpret=args.interpret)

                def with_static(fn, p=p):
                    # the jitted call takes p's arrays; its dtype and scale come back as constants
                    return jax.jit(lambda arrays, *rest: fn(arrays._replace(io_dtype=p.io_dtype, scale=p.scale), *rest))

                def map_pass(p, w, u, kd, qg, aqk, init):
                    return mgs.state_lanes(p.lay.row_first_chunk, p.lay.row_num_chunks, None, None,
                                           p.G[:, :, 63, :] if channel else p.G, w, u, kd, None, None, None,
                                           per_channel_decay=channel, group=1, map_mode=True,
                                           interpret=args.interpret)

                runs = {"v1 state_pass": with_static(functools.partial(mgd.state_pass, **options)),
                        "v2 state_pass_v2": with_static(functools.partial(mgs.state_pass_v2, **options))}
                for variant in args.variants:
                    tuning = implementation_spec(f"v2@{variant}")[1]
                    runs[f"v2 {variant}"] = with_static(functools.partial(mgs.state_pass_v2, **options, **tuning))
                runs["v2 map_mode"] = with_static(map_pass)
                call = (p._replace(io_dtype=None, scale=None), *tiles, init)
                lay = p.lay
                token_valid = np.asarray(lay.token_valid)
                rows = (np.asarray(lay.token_chunk)[token_valid], np.asarray(lay.token_pos)[token_valid])
                ck_valid = np.asarray(lay.checkpoint_valid)
                baseline = None
                label = f"{op} ({batch}, {tokens}, {heads}) K=V={args.dim} bf16 ckpts/row={num_ckpt}"
                for name, fn in runs.items():
                    out, wall, kernels, device_ms = time_call(fn, call, reps=args.reps,
                                                              trace_reps=max(args.reps // 4, 1))
                    named = ", ".join(f"{k} {v:.3f}" for k, v in kernels.items() if "delta_state" in k)
                    note = ""
                    if name.startswith("v1"):
                        baseline = out
                    elif name != "v2 map_mode":
                        # v2's o is in token order, v1's chunk-major
                        o_a = np.asarray(jnp.asarray(out[0], jnp.float32))[token_valid]
                        o_b = np.asarray(jnp.asarray(baseline[0], jnp.float32))[rows]
                        note = (f"  vs v1 max-rel: o {max_rel(o_a, o_b):.1e} final {max_rel(out[1], baseline[1]):.1e}"
                                f" ckpt {max_rel(np.asarray(out[2])[ck_valid], np.asarray(baseline[2])[ck_valid]):.1e}")
                    print(f"{label} {name:26s} wall {wall:8.3f} ms  device {device_ms:8.3f} ms [{named}]{note}",
                          flush=True)


if __name__ == "__main__":
    main()
