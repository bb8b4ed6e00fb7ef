"""The fused GDN pass (`pallas_mosaic_gpu_gdn_fused`: gdn_kkt + gdn_fused_lanes) vs the unfused Mosaic GPU pipeline
(`gdn_intra` + `pallas_mosaic_gpu_delta.state_pass`, and + `pallas_mosaic_gpu_state.state_pass_v2`) on one Hopper
GPU, from the same `prepare`.

GPU: `python -m bench.mosaic_gpu_gdn_fused_quick [--shapes 1x8192x16 1x32768x16 8x4096x32] [--checkpoints 0 8]
[--reps 20]`. Per shape B x T x H (B rows of T tokens, H = HV heads, K = V = 128, bf16, l2-normalized q, k,
initial states), `pallas_triton_delta.prepare` runs once; then each pipeline is jitted on its outputs and timed:
wall = median of `bench.common.jax_time` (device-synced calls, compile excluded); device = the kernels of one call
from a profiler trace (`bench.profile_delta.kernel_times`), total and per kernel. Printed for the fused pass: max
relative difference (max |a - b| / max |b|) against the unfused v1 pipeline of o (real tokens), final states and
checkpoints (both are ~1e-3 from float64: tests/gpu/test_mosaic_gpu_gdn_fused.py measures which is closer).
"(blocked)" pipelines run the "blocked" inverse (`pallas_mosaic_gpu_intra` docstring) in `gdn_intra` or `gdn_kkt`.
`--interpret` is a CPU dry run at tiny sizes (e.g. `--shapes 1x130x1 --dim 64 --reps 1`), not a measurement.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402


def prepared(rng, batch, tokens, heads, dim, num_checkpoints, interpret):
    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.common import pallas_triton_delta as triton_delta

    T = batch * tokens
    x = dict(q=rng.normal(size=(T, heads, dim)), k=rng.normal(size=(T, heads, dim)), v=rng.normal(size=(T, heads, dim)),
             g=-rng.exponential(0.3, size=(T, heads)), beta=rng.uniform(0.05, 0.95, (T, heads)))
    x = {name: jnp.asarray(a, jnp.bfloat16 if name in "qkv" else jnp.float32) for name, a in x.items()}
    offsets = np.linspace(0, tokens, num_checkpoints + 2)[1:-1].astype(np.int32)
    offsets[::2] = offsets[::2] // 64 * 64  # every other one on a chunk boundary
    offsets = np.unique(np.clip(offsets, 1, tokens - 1)).astype(np.int32) if num_checkpoints else offsets[:0]
    cu = np.arange(batch + 1, dtype=np.int32) * tokens
    ck_cu = np.arange(batch + 1, dtype=np.int32) * offsets.size

    @jax.jit
    def prepare(q, k, v, g, beta):
        p = triton_delta.prepare(q, k, v, g, beta, per_channel_decay=False, scale=None, use_qk_l2norm=True,
                                 cu_seqlens=jnp.asarray(cu), checkpoint_cu=jnp.asarray(ck_cu),
                                 checkpoint_offsets=jnp.asarray(np.tile(offsets, batch)), chunk_size=64,
                                 interpret=interpret)
        return p._replace(io_dtype=None, scale=None)  # static fields restored below

    p = jax.block_until_ready(prepare(*(x[name] for name in ("q", "k", "v", "g", "beta"))))
    p = p._replace(io_dtype=jnp.dtype(jnp.bfloat16), scale=dim ** -0.5)
    init = jnp.asarray(0.1 * rng.normal(size=(batch, heads, dim, dim)), jnp.float32)
    return p, init


def max_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) if b.size else 0.0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1x8192x16", "1x32768x16", "8x4096x32"])
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[0, 8])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--interpret", action="store_true")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from bench.common import jax_time
    from bench.profile_delta import kernel_times
    from jaxckpt.ops.common import pallas_mosaic_gpu_delta as mgd
    from jaxckpt.ops.common import pallas_mosaic_gpu_gdn_fused as fused
    from jaxckpt.ops.common import pallas_mosaic_gpu_intra as mgi
    from jaxckpt.ops.common import pallas_mosaic_gpu_state as mgs

    print(f"devices: {jax.devices()}", flush=True)
    rng = np.random.default_rng(0)
    interpret = args.interpret

    def unfused(state_pass, **tuning):
        def run(p, init):
            tiles = mgi.gdn_intra(p.lay.chunk_start, p.lay.chunk_len, p.q, p.k, p.v, p.beta, p.G, chunk=64,
                                  group=p.v.shape[1] // p.q.shape[1], scale=p.scale, interpret=interpret, **tuning)
            return state_pass(p, *tiles, init, per_channel_decay=False, interpret=interpret)
        return run

    def kkt_only(inverse):
        def run(p, init):
            lay = p.lay
            return fused.gdn_kkt(lay.chunk_start, lay.chunk_len, p.q, p.k, p.v, p.beta, group=1, interpret=interpret,
                                 inverse=inverse)
        return run

    def fused_pass(kkt_inverse):
        return lambda p, init: fused.gdn_fused_pass(p, init, interpret=interpret, kkt_inverse=kkt_inverse)

    pipelines = {"unfused intra+state_pass": unfused(mgd.state_pass),
                 "unfused intra+state_pass_v2": unfused(mgs.state_pass_v2),
                 "unfused intra+state_pass_v2 (blocked)": unfused(mgs.state_pass_v2, inverse="blocked"),
                 "fused gdn_fused_pass": fused_pass("f16"),
                 "fused gdn_fused_pass (blocked)": fused_pass("blocked"),
                 "fused gdn_kkt alone": kkt_only("f16"),
                 "fused gdn_kkt alone (blocked)": kkt_only("blocked")}
    for shape in args.shapes:
        batch, tokens, heads = (int(n) for n in shape.split("x"))
        for num_ckpt in args.checkpoints:
            p, init = prepared(rng, batch, tokens, heads, args.dim, num_ckpt, interpret)
            call = (p._replace(io_dtype=None, scale=None), init)
            lay = p.lay
            token_valid = np.asarray(lay.token_valid)
            rows = (np.asarray(lay.token_chunk)[token_valid], np.asarray(lay.token_pos)[token_valid])
            ck_valid = np.asarray(lay.checkpoint_valid)
            label = f"gdn ({batch}, {tokens}, {heads}) K=V={args.dim} bf16 ckpts/row={num_ckpt}"
            baseline = None
            for name, run in pipelines.items():
                # the jitted call takes p's arrays; its dtype and scale come back as constants
                fn = jax.jit(lambda arrays, init, run=run, p=p: run(arrays._replace(io_dtype=p.io_dtype,
                                                                                     scale=p.scale), init))
                out = jax.block_until_ready(fn(*call))
                wall = jax_time(fn, *call, reps=args.reps)["median_ms"]
                kernels, device_ms = kernel_times(fn, call, reps=max(args.reps // 4, 1))
                named = ", ".join(f"{k} {v:.3f}" for k, v in kernels.items())
                note = ""
                if baseline is None:
                    baseline = out
                elif name.startswith("fused gdn_fused_pass"):
                    # the fused pass's o is in token order, v1's chunk-major
                    o_a = np.asarray(jnp.asarray(out[0], jnp.float32))[token_valid]
                    o_b = np.asarray(jnp.asarray(baseline[0], jnp.float32))[rows]
                    note = (f"\n    vs unfused v1 max-rel: o {max_rel(o_a, o_b):.1e} final "
                            f"{max_rel(out[1], baseline[1]):.1e} ckpt "
                            f"{max_rel(*(np.asarray(x[2])[:ck_valid.size][ck_valid] for x in (out, baseline))):.1e}")
                print(f"{label} {name:38s} wall {wall:8.3f} ms  device {device_ms:8.3f} ms\n    kernels (ms): "
                      f"[{named}]{note}", flush=True)


if __name__ == "__main__":
    main()
