"""Grouped matmul (`jaxckpt.ops.grouped_matmul`) at MoE sizes against a dense matmul of the same FLOPs and torch's
grouped matmul, on one GPU.

GPU: `python -m bench.grouped_matmul [--tokens 8192 32768] [--variants 128,128,64,8,4 ...] [--name NAME]`;
CPU dry run (no measurement): `--interpret --tokens 64 --experts 8 --top-k 2 --proj 32x48 --variants 16,16,16,4,1`.
Shapes: T tokens routed top-10 over 512 experts (each token picks 10 distinct experts uniformly at random, so the
group sizes are random with mean 10 T / 512), M = 10 T pairs, in both MoE projections: K 2048 -> N 1024
(Qwen3-Next's gate_up) and K 512 -> N 2048 (its down). bf16 inputs and outputs, fp32 accumulation. Rows:
- pallas_triton: the op's kernel with `default_config`; pallas_triton@block_m=..,.. the `--variants` tiles
  (block_m, block_n, block_k, num_warps, num_stages);
- dense_xla: jnp.dot [M, K] x [K, N] (one expert's weights for all rows: the same FLOPs, the roofline to compare
  with); xla_ragged_dot: jax.lax.ragged_dot (records its error when XLA's dense lowering does not fit);
- torch_grouped_mm: torch._grouped_mm(lhs, rhs, offs) on the same data, torch_dense: torch.mm of the dense shape;
- with `--fp32` (default on for the first shape): the kernel and dense_xla in fp32 (TF32 products).
JAX rows: median wall time of device-synced calls (`jax_time`), device_ms summed over the kernels of a profiler
trace (the tile table's few small jnp kernels included) and pipelined_ms (back-to-back calls); TFLOP/s =
2 M K N / device_ms (pipelined_ms without a trace). torch rows: `triton.testing.do_bench`; TFLOP/s from its median.
The kernel's output is checked on 16 groups (largest, empty and random ones) against fp32 products: max_rel.
Writes NAME.json / NAME.md (bench/common.py's schema) under $OUT or bench/results.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from bench.common import Recorder, jax_pipelined, jax_time, kernel_times, out_dir, torch_time  # noqa: E402


def routing_sizes(rng, tokens: int, experts: int, top_k: int) -> np.ndarray:
    """i32[E]: pairs per expert when every token picks top_k distinct experts uniformly."""
    picks = np.argpartition(rng.random((tokens, experts), dtype=np.float32), top_k, axis=1)[:, :top_k]
    return np.bincount(picks.reshape(-1), minlength=experts).astype(np.int32)


def parse_variant(text: str):
    from jaxckpt.ops.grouped_matmul import GroupedMatmulConfig

    block_m, block_n, block_k, num_warps, num_stages = (int(v) for v in text.split(","))
    return GroupedMatmulConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                               num_stages=num_stages)


def spot_error(out, lhs, rhs, sizes, rng) -> float:
    """max |out - ref| / max |ref| over 16 groups, ref = fp32 products of the same inputs on the device."""
    import jax
    import jax.numpy as jnp

    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    picks = {int(np.argmax(sizes)), int(np.argmin(sizes)), *rng.choice(sizes.size, min(14, sizes.size), replace=False).tolist()}
    worst, scale = 0.0, 0.0
    for g in sorted(picks):
        rows = slice(int(starts[g]), int(starts[g] + sizes[g]))
        want = jnp.dot(lhs[rows].astype(jnp.float32), rhs[g].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        worst = max(worst, float(jnp.abs(out[rows].astype(jnp.float32) - want).max(initial=0.0)))
        scale = max(scale, float(jnp.abs(want).max(initial=0.0)))
    return worst / max(scale, 1e-30)


def time_jax(fn, *args) -> dict:
    timing = jax_time(fn, *args, warmup=3, reps=20)
    try:
        _, device_ms = kernel_times(fn, args, reps=10)
    except Exception as err:  # noqa: BLE001 - a trace that fails leaves the wall and pipelined times
        print(f"    no trace: {err!r}", flush=True)
        device_ms = None
    return {**timing, "device_ms": device_ms, "pipelined_ms": jax_pipelined(fn, *args)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--experts", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--proj", nargs="+", default=["2048x1024", "512x2048"], help="KxN per projection")
    parser.add_argument("--interpret", action="store_true", help="CPU dry run of this script (tiny sizes)")
    parser.add_argument("--variants", nargs="*", default=["64,256,64,8,3", "128,128,64,8,4", "128,256,64,8,3"],
                        help="block_m,block_n,block_k,num_warps,num_stages per variant")
    parser.add_argument("--fp32", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--name", default="grouped_matmul")
    args = parser.parse_args(argv)

    import functools

    import jax
    import jax.numpy as jnp

    from jaxckpt.ops.grouped_matmul import default_config, grouped_matmul, pallas_triton

    print(f"devices: {jax.devices()}", flush=True)
    rec = Recorder(args.name, out_dir())
    variants = [None] + [parse_variant(v) for v in args.variants]
    rng = np.random.default_rng(0)
    if args.interpret:
        args.no_torch = True
    first = True
    for tokens in args.tokens:
        sizes = routing_sizes(rng, tokens, args.experts, args.top_k)
        rows = int(sizes.sum())
        for depth, width in (tuple(int(v) for v in p.split("x")) for p in args.proj):
            shape = dict(T=tokens, M=rows, K=depth, N=width, G=args.experts, min_group=int(sizes.min()),
                         max_group=int(sizes.max()))
            flops = 2.0 * rows * depth * width
            dtypes = [jnp.bfloat16] + ([jnp.float32] if args.fp32 and first else [])
            for dtype in dtypes:
                name = jnp.dtype(dtype).name
                key = jax.random.key(rows + depth)
                lhs = jax.random.normal(key, (rows, depth), dtype)
                rhs = (jax.random.normal(jax.random.fold_in(key, 1), (args.experts, depth, width), dtype)
                       * depth ** -0.5).astype(dtype)
                group_sizes = jnp.asarray(sizes)

                def add(impl, timing, note="", **extra):
                    ms = timing.get("device_ms") or timing.get("pipelined_ms") or timing["median_ms"]
                    tflops = flops / ms / 1e9
                    checked = f"; max_rel {extra['max_rel']:.1e}" if "max_rel" in extra else ""
                    rec.add(op="grouped_matmul", implementation=impl, shape=shape, rows=rows, checkpoints=0,
                            dtype=name, note=f"{tflops:.0f} TFLOP/s{checked}; {note}", tflops=tflops, **timing,
                            **extra)

                for config in variants:
                    impl = "pallas_triton" if config is None else (
                        "pallas_triton@" + ",".join(f"{k}={v}" for k, v in vars(config).items()))
                    if args.interpret:
                        fn = functools.partial(pallas_triton.grouped_matmul, config=config, interpret=True)
                    else:
                        fn = jax.jit(functools.partial(grouped_matmul, config=config,
                                                       implementation="pallas_triton"))
                    try:
                        out = jax.block_until_ready(fn(lhs, rhs, group_sizes))
                        timing = time_jax(fn, lhs, rhs, group_sizes)
                    except Exception as err:  # noqa: BLE001 - a variant that fails to compile is recorded
                        rec.add(op="grouped_matmul", implementation=impl, shape=shape, rows=rows, checkpoints=0,
                                dtype=name, median_ms=None, note=f"failed: {type(err).__name__}: {str(err)[:300]}")
                        continue
                    used = config or default_config(rows, depth, width, args.experts, dtype)
                    add(impl, timing, note=f"config {vars(used)}", max_rel=spot_error(out, lhs, rhs, sizes, rng))
                    del out
                    if dtype == jnp.float32:
                        break  # fp32: the default tiles only
                dense_rhs = rhs[0]
                add("dense_xla", time_jax(jax.jit(jnp.dot), lhs, dense_rhs), note="[M, K] x [K, N], same FLOPs")
                if dtype == jnp.bfloat16:
                    try:
                        ragged = jax.jit(jax.lax.ragged_dot)
                        jax.block_until_ready(ragged(lhs, rhs, group_sizes))
                        add("xla_ragged_dot", time_jax(ragged, lhs, rhs, group_sizes))
                    except Exception as err:  # noqa: BLE001 - XLA's dense lowering runs out of memory here
                        rec.add(op="grouped_matmul", implementation="xla_ragged_dot", shape=shape, rows=rows,
                                checkpoints=0, dtype=name, median_ms=None,
                                note=f"failed: {type(err).__name__}: {str(err)[:200]}")
                if dtype == jnp.bfloat16 and not args.no_torch:
                    time_torch(add, rec, shape, rows, np.asarray(lhs), np.asarray(rhs), sizes)
                del lhs, rhs
            first = False
    print(f"wrote {rec.write()}", flush=True)


def time_torch(add, rec, shape, rows, lhs, rhs, sizes):
    try:
        import torch
    except ImportError:
        return
    # bf16 crosses as its bits: numpy has no bfloat16 of torch's
    a = torch.from_numpy(lhs.view(np.uint16)).cuda().view(torch.bfloat16)
    b = torch.from_numpy(rhs.view(np.uint16)).cuda().view(torch.bfloat16)
    offs = torch.from_numpy(np.cumsum(sizes).astype(np.int32)).cuda()
    with torch.inference_mode():
        note = "rhs [G, K, N] row-major"
        try:
            torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)
        except Exception as err:  # noqa: BLE001 - some builds want rhs column-major per group
            note = f"rhs column-major per group (row-major: {type(err).__name__})"
            b = b.transpose(-2, -1).contiguous().transpose(-2, -1)
        try:
            add("torch_grouped_mm", torch_time(lambda: torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)),
                note=note)
        except Exception as err:  # noqa: BLE001 - recorded, not fatal
            rec.add(op="grouped_matmul", implementation="torch_grouped_mm", shape=shape, rows=rows, checkpoints=0,
                    dtype="bfloat16", median_ms=None, note=f"failed: {type(err).__name__}: {str(err)[:300]}")
        dense = b[0].contiguous()
        add("torch_dense", torch_time(lambda: torch.mm(a, dense)), note="[M, K] x [K, N], same FLOPs")
    del a, b
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
