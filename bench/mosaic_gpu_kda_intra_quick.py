"""The KDA intra-chunk pass: the Mosaic GPU kernel (`pallas_mosaic_gpu_kda_intra.kda_intra`) against the Triton KDA
intra launches it replaces (`pallas_triton_delta.intra_v2(..., per_channel_decay=True)`, default "split"), on one GPU.

GPU: `python -m bench.mosaic_gpu_kda_intra_quick [--tokens 8192 32768] [--heads 16] [--dtype bfloat16]
[--variants ...]`. Per shape (one row of T tokens, H = HV heads, K = V = 128, l2-normalized q and k), every pass
gets the same `prepare` output (chunk layout, casts, G; not timed); prints for each (`bench.common.time_call`) the
median wall time of a jitted, device-synced call (20 after 5 warmup calls), the device time of its kernels from a
profiler trace, and the errors of every Mosaic GPU output against the Triton one (max |a - b| / max |b| and
rel-RMS).

`--variants`: the Mosaic GPU tuning options to time (`VARIANTS`; no names: all of them); without the flag, only
`default` (`default_tuning`'s choice). The kernel's first version (one CTA per SM, whole-tile registers, split
inverse) measured 1.089 ms at T 8192 (`bench/results/mosaic_gpu_kda_intra_h200.log`); "split_parts2" is today's
kernel with that version's precision options.

`make_inputs`, `prepared`, `triton_kda_intra` and `mosaic_kda_intra` are shared with the tests.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from bench.common import max_rel, rel_rms, time_call  # noqa: E402

OUTPUTS = ("w", "u", "kd", "qg", "aqk")
CHUNK = 64
# name -> `kda_intra` tuning options (16-bit inputs; fp32 ones take only "default")
VARIANTS = {
    "default": {},
    "split": dict(inverse="split"),
    "parts2": dict(score_parts=2),
    "split_parts2": dict(score_parts=2, inverse="split"),
    "shifted": dict(reference="shifted"),
    "blocked": dict(inverse="blocked"),
}


def make_inputs(rng, num_tokens, num_heads, num_v_heads, head_k, head_v, *, strong=False):
    """fp32 numpy q, k (l2-normalized per token), v, per-channel log decays g [T, HV, K] <= 0 and beta in (0, 1).

    Default decays: mostly mild, a few strong channels. strong=True: every channel decays by 3 to 6 per token, with
    -30 spikes, so a chunk's G falls far below -88 (exp(-G) overflows fp32) and many factors underflow.
    """
    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    g_shape = (num_tokens, num_v_heads, head_k)
    if strong:
        g = -rng.uniform(3.0, 6.0, size=g_shape) - np.where(rng.random(g_shape) < 0.02, 30.0, 0.0)
    else:
        g = -rng.exponential(0.1, size=g_shape) - np.where(rng.random(g_shape) < 0.03, 3.0, 0.0)
    return dict(q=unit(rng.normal(size=(num_tokens, num_heads, head_k))).astype(np.float32),
                k=unit(rng.normal(size=(num_tokens, num_heads, head_k))).astype(np.float32),
                v=rng.normal(size=(num_tokens, num_v_heads, head_v)).astype(np.float32),
                g=g.astype(np.float32),
                beta=rng.uniform(0.05, 0.95, size=(num_tokens, num_v_heads)).astype(np.float32))


def prepared(x, cu_seqlens, dtype, *, interpret=False):
    """`pallas_triton_delta.prepare` of the inputs x (q, k, v in `dtype`): layout, casts and G [HV, NC, C, K]."""
    import jax.numpy as jnp

    from jaxckpt.ops.common import pallas_triton_delta as ptd

    q, k, v = (jnp.asarray(x[name], dtype) for name in ("q", "k", "v"))
    return ptd.prepare(q, k, v, jnp.asarray(x["g"]), jnp.asarray(x["beta"]), per_channel_decay=True, scale=None,
                       use_qk_l2norm=False, cu_seqlens=jnp.asarray(cu_seqlens, jnp.int32), checkpoint_cu=None,
                       checkpoint_offsets=None, chunk_size=CHUNK, interpret=interpret)


def triton_kda_intra(p, q, k, v, beta, G, *, interpret=False):
    """(w, u, kd, qg, aqk) of the Triton KDA intra launches (`intra_v2`, default "split") on p's layout."""
    from jaxckpt.ops.common import pallas_triton_delta as ptd

    return ptd.intra_v2(p._replace(q=q, k=k, v=v, beta=beta, G=G), per_channel_decay=True, chunk_size=CHUNK,
                        interpret=interpret)


def mosaic_kda_intra(p, q, k, v, beta, G, *, interpret=False, **tuning):
    """(w, u, kd, qg, aqk) of the Mosaic GPU kernel on p's layout."""
    from jaxckpt.ops.common.pallas_mosaic_gpu_kda_intra import kda_intra

    return kda_intra(p.lay.chunk_start, p.lay.chunk_len, q, k, v, beta, G, chunk=CHUNK,
                     group=v.shape[1] // q.shape[1], scale=p.scale, interpret=interpret, **tuning)


def main():
    import functools

    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.common.pallas_mosaic_gpu_kda_intra import default_tuning

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--variants", nargs="*", choices=sorted(VARIANTS), default=None,
                        help="Mosaic GPU tuning variants to time (no names: all)")
    parser.add_argument("--interpret", action="store_true",
                        help="all kernels in their CPU interpreters: a smoke run of this script, times meaningless")
    args = parser.parse_args()
    variants = ["default"] if args.variants is None else args.variants or list(VARIANTS)
    dtype = jnp.dtype(args.dtype)
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, H = HV = {args.heads}, "
          f"K = V = {args.dim}, {dtype.name}")
    for num_tokens in args.tokens:
        x = make_inputs(np.random.default_rng(0), num_tokens, args.heads, args.heads, args.dim, args.dim)
        p = jax.block_until_ready(prepared(x, [0, num_tokens], dtype, interpret=args.interpret))
        inputs = (p.q, p.k, p.v, p.beta, p.G)
        triton = jax.jit(functools.partial(triton_kda_intra, p, interpret=args.interpret))
        reference = triton(*inputs)
        passes = [("triton", triton, None)]
        for name in variants:
            tuning = {**default_tuning(dtype), **VARIANTS[name]}
            passes.append((f"{name} {tuning}", jax.jit(functools.partial(mosaic_kda_intra, p, interpret=args.interpret,
                                                                         **VARIANTS[name])), name))
        for label, fn, name in passes:
            outputs, wall, per_kernel, total = time_call(fn, inputs, warmup=5, reps=20)
            kernels = ", ".join(f"{kernel} {ms:.3f}" for kernel, ms in sorted(per_kernel.items()))
            print(f"T {num_tokens:6d} {label}: wall {wall:.3f} ms, device {total:.3f} ms ({kernels})", flush=True)
            if name is not None:
                errors = ", ".join(f"{out} {max_rel(a, b):.2e}/{rel_rms(a, b):.2e}"
                                   for out, a, b in zip(OUTPUTS, outputs, reference))
                print(f"T {num_tokens:6d} {name}: vs triton (max rel / rel-RMS): {errors}", flush=True)


if __name__ == "__main__":
    main()
