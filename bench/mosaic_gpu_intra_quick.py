"""The GDN intra-chunk pass: the Mosaic GPU kernel (`pallas_mosaic_gpu_intra.gdn_intra`) against the Triton-lowered
`_intra_kernel_v2` it replaces, on one GPU.

GPU: `python -m bench.mosaic_gpu_intra_quick [--tokens 8192 32768] [--heads 16] [--dtype bfloat16] [--variants ...]`.
Per shape (one row of T tokens, H = HV heads, K = V = 128, l2-normalized q and k as GDN layers feed them), every
pass gets the same chunk layout and the same G (`_cumsum_kernel`, not timed); prints for each
(`bench.common.time_call`) the median wall time of a jitted, device-synced call (20 after warmup), the device time
of the kernels from a profiler trace, and the errors of every Mosaic GPU output against the Triton one
(max |a - b| / max |b| and rel-RMS).

`--variants`: the Mosaic GPU tuning options to time (`VARIANTS`; no names: all of them); without the flag, only
`default` (`default_tuning`'s choice for the shape).

`triton_intra` (the Triton pass called as `delta_rule` calls it) and `make_inputs` are shared with the tests.
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from bench.common import max_rel, rel_rms, time_call  # noqa: E402

OUTPUTS = ("w", "u", "kd", "qg", "aqk")
# name -> `gdn_intra` tuning options; "first" is the kernel's first version (the default before the options)
VARIANTS = {
    "default": {},
    "first": dict(inverse="split", chunks_per_cta=1, landing="rows"),
    "f16_rows": dict(inverse="f16", chunks_per_cta=1, landing="rows"),
    "swizzled": dict(inverse="split", chunks_per_cta=1, landing="swizzled"),
    "f16": dict(inverse="f16", chunks_per_cta=1, landing="swizzled"),
    "split_cta4": dict(inverse="split", chunks_per_cta=4, landing="swizzled"),
    "f16_cta4_rows": dict(inverse="f16", chunks_per_cta=4, landing="rows"),
    "f16_cta2": dict(inverse="f16", chunks_per_cta=2, landing="swizzled"),
    "f16_cta4": dict(inverse="f16", chunks_per_cta=4, landing="swizzled"),
    "f16_cta8": dict(inverse="f16", chunks_per_cta=8, landing="swizzled"),
    "blocked": dict(inverse="blocked", chunks_per_cta=1, landing="swizzled"),
}


def make_inputs(rng, num_tokens, num_heads, num_v_heads, head_k, head_v):
    """fp32 numpy q, k (l2-normalized per token), v, g (log decays <= 0, a few strong ones) and beta in (0, 1)."""
    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    g_shape = (num_tokens, num_v_heads)
    g = -rng.exponential(0.3, size=g_shape) - np.where(rng.random(g_shape) < 0.05, 4.0, 0.0)
    return dict(q=unit(rng.normal(size=(num_tokens, num_heads, head_k))).astype(np.float32),
                k=unit(rng.normal(size=(num_tokens, num_heads, head_k))).astype(np.float32),
                v=rng.normal(size=(num_tokens, num_v_heads, head_v)).astype(np.float32),
                g=g.astype(np.float32),
                beta=rng.uniform(0.05, 0.95, size=g_shape).astype(np.float32))


def layout(cu_seqlens, num_tokens, chunk=64):
    """chunk_start, chunk_len (i32[NC]) of packed rows, as `delta_rule` builds them (no checkpoints)."""
    import jax.numpy as jnp

    from jaxckpt.plan.layout import chunk_layout

    rows = len(cu_seqlens) - 1
    lay = chunk_layout(jnp.asarray(cu_seqlens, jnp.int32), jnp.zeros(rows + 1, jnp.int32), jnp.zeros(0, jnp.int32),
                       chunk_size=chunk, num_tokens=num_tokens, xp=jnp)
    return lay.chunk_start, lay.chunk_len


def gate_cumsum(chunk_start, chunk_len, g, *, chunk=64, interpret=False):
    """G = fp32 [HV, NC, C], the Triton `_cumsum_kernel` launch of `delta_rule`."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from jaxckpt.ops.common import pallas_triton_delta as ptd

    num_chunks, num_v_heads = chunk_start.shape[0], g.shape[1]
    full = pl.BlockSpec()
    return pl.pallas_call(
        functools.partial(ptd._cumsum_kernel, chunk=chunk, channel=False),
        out_shape=jax.ShapeDtypeStruct((num_v_heads, num_chunks, chunk), jnp.float32),
        grid=(num_chunks, num_v_heads), in_specs=[full, full, full],
        out_specs=pl.BlockSpec((None, None, chunk), lambda c, h: (h, c, 0)), interpret=interpret,
    )(chunk_start, chunk_len, g.astype(jnp.float32))


def triton_intra(chunk_start, chunk_len, q, k, v, beta, G, *, group, scale, chunk=64, interpret=False,
                 num_warps=4):
    """(w, u, kd, qg, aqk) of the Triton `_intra_kernel_v2` launch, with `delta_rule`'s arguments for GDN."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    from jaxckpt.ops.common import pallas_triton_delta as ptd
    from jaxckpt.ops.common.pallas_triton_tiles import Dots

    io_dtype = jnp.promote_types(k.dtype, v.dtype)
    io_dtype = jnp.float32 if io_dtype.itemsize >= 4 else io_dtype
    q, k = q.astype(io_dtype), k.astype(io_dtype)
    num_chunks = chunk_start.shape[0]
    num_v_heads = v.shape[1]
    widths = (k.shape[-1], v.shape[-1], k.shape[-1], k.shape[-1], chunk)
    full = pl.BlockSpec()
    block = lambda width: pl.BlockSpec((None, None, chunk, width), lambda c, h: (h, c, 0, 0))
    return pl.pallas_call(
        functools.partial(ptd._intra_kernel_v2, chunk=chunk, group=group, channel=False, scale=float(scale),
                          dots=Dots(io_dtype)),
        out_shape=tuple(jax.ShapeDtypeStruct((num_v_heads, num_chunks, chunk, w), io_dtype) for w in widths),
        grid=(num_chunks, num_v_heads), in_specs=[full] * 6 + [pl.BlockSpec((None, None, chunk),
                                                                            lambda c, h: (h, c, 0))],
        out_specs=tuple(block(w) for w in widths),
        compiler_params=plt.CompilerParams(num_warps=num_warps), interpret=interpret, name="delta_intra",
    )(chunk_start, chunk_len, q, k, v, beta, G)


def main():
    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.common.pallas_mosaic_gpu_intra import default_tuning, gdn_intra

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
        q, k, v = (jnp.asarray(x[name], dtype) for name in ("q", "k", "v"))
        beta = jnp.asarray(x["beta"], dtype)
        chunk_start, chunk_len = layout([0, num_tokens], num_tokens)
        G = jax.block_until_ready(gate_cumsum(chunk_start, chunk_len, jnp.asarray(x["g"]), interpret=args.interpret))
        options = dict(group=1, scale=args.dim ** -0.5, interpret=args.interpret)
        inputs = (chunk_start, chunk_len, q, k, v, beta, G)
        triton = jax.jit(functools.partial(triton_intra, **options))
        reference = triton(*inputs)
        passes = [("triton", triton, None)]
        for name in variants:
            tuning = VARIANTS[name] or default_tuning(jnp.promote_types(k.dtype, v.dtype))
            passes.append((f"{name} {tuning}", jax.jit(functools.partial(gdn_intra, chunk=64, **options,
                                                                         **VARIANTS[name])), name))
        for label, fn, name in passes:
            outputs, wall, per_kernel, total = time_call(fn, inputs, warmup=5, reps=20)
            kernels = ", ".join(f"{kernel} {ms:.3f}" for kernel, ms in sorted(per_kernel.items()))
            print(f"T {num_tokens:6d} {label}: wall {wall:.3f} ms, device {total:.3f} ms ({kernels})")
            if name is not None:
                errors = ", ".join(f"{out} {max_rel(a, b):.2e}/{rel_rms(a, b):.2e}"
                                   for out, a, b in zip(OUTPUTS, outputs, reference))
                print(f"T {num_tokens:6d} {name}: vs triton (max rel / rel-RMS): {errors}")


if __name__ == "__main__":
    main()
