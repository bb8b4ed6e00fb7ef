"""Times `implementation="sequence_parallel"` (issue #7) against the plain Pallas kernels, FLA and jla in one run.

GPU (one H200), one call per op so each fits a 10-minute call:
  `python -m bench.sequence_parallel --ops gdn --peers fla jla --name sequence_parallel_gdn_h200`
  `python -m bench.sequence_parallel --ops kda --peers fla jla --name sequence_parallel_kda_h200`
(results under $OUT when set, else bench/results/). CPU smoke run of the script: `--tiny` (interpret mode).

Shapes (B, T, H) with K = V = 128, HV = H: (1, 32768, 16), (1, 131072, 16) and the batched anchor (8, 4096, 32).
Inputs as `bench.cases` (bf16 q, k, v; fp32 log decays and beta; an fp32 initial state per row). Modes: `none`
(initial state, no checkpoint), `per_row` (initial state + one checkpoint per row, the last 512-token boundary: the
issue's "including an initial state and one checkpoint"), optionally `every_1024`. Every timed configuration is
checked once against the plain Pallas call on the same inputs (rel-RMS of o / final / checkpoints, in the row's
note), so a wrong GPU result cannot hide behind a fast time. Variants (`--variants`, default: default and L4096)
sweep the piece length, the cut policy, the compose order and the base's fused output. Configurations that would
start after `--deadline-s` are recorded as skipped.
Goals (issue #7): GDN (1, 32768, 16) per_row < 0.5 ms, (1, 131072, 16) about 4x that; KDA (1, 32768, 16) >= 1.5x
faster than jla (2.18 ms when the issue was written); no regression against pallas_triton at (8, 4096, 32).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from bench.cases import LONG_SHAPES, checkpoint_lists, delta_inputs  # noqa: E402
from bench.common import Recorder, attempt, jax_time, out_dir, rel_rms  # noqa: E402
from bench.ops_bench import bench_fla_delta, bench_jla_delta  # noqa: E402

TINY_SHAPES = [(1, 512, 2), (2, 256, 2)]
# (label, config fields) of the sequence-parallel runs; {} = the defaults (piece length from the shape);
# fuse_output goes to the Pallas base's config
VARIANTS = {
    "default": {},
    "L1024": {"piece_len": 1024},
    "L2048": {"piece_len": 2048},
    "L4096": {"piece_len": 4096},
    "L8192": {"piece_len": 8192},
    "grid_cuts": {"piece_cuts": "grid"},
    "sequential_compose": {"compose": "sequential"},
    "fused_output": {"fuse_output": True},
}


def variant_config(name: str, interpret: bool):
    from jaxckpt import ops

    fields = dict(VARIANTS[name])
    base = {key: fields.pop(key) for key in ("fuse_output",) if key in fields}
    base_config = ops.DeltaPallasTritonConfig(interpret=interpret, **base) if base else None
    return ops.SequenceParallelConfig(interpret=interpret, base_config=base_config, **fields)


def bench_shape(rec, kind, lengths, H, D, label, modes, variants, interpret, check, deadline):
    import jax
    import jax.numpy as jnp

    from jaxckpt import ops
    from jaxckpt.ops.delta_rule.sequence_parallel import choose_piece_len

    fn = ops.gated_delta_rule if kind == "gdn" else ops.kda
    q, k, v, g, beta, h0, cu = delta_inputs(lengths, H, D, kind)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    args = (bf(q), bf(k), bf(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(h0), jnp.asarray(cu))
    chosen, reason = choose_piece_len(num_tokens=int(cu[-1]), num_rows=len(lengths), num_v_heads=H, head_k=D,
                                      head_v=D, chunk_size=64)
    print(f"   default plan: piece_len={chosen} {reason or ''}", flush=True)
    for mode in modes:
        ccu, offsets = checkpoint_lists(lengths, mode)
        extra = (jnp.asarray(ccu), jnp.asarray(offsets))
        runs = [("pallas_triton", "plain", ops.DeltaPallasTritonConfig(interpret=interpret))]
        runs += [("sequence_parallel", name, variant_config(name, interpret)) for name in variants]
        plain_out = None
        for impl, name, config in runs:
            if time.monotonic() > deadline:
                rec.add(op=kind, implementation=f"{impl}:{name}", shape=label, checkpoints=mode, median_ms=None,
                        note="skipped: past --deadline-s")
                continue
            f = jax.jit(lambda q, k, v, g, beta, h0, cu, ccu, off, config=config: fn(
                q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=off,
                config=config))

            def run(f=f, impl=impl, name=name):
                nonlocal plain_out
                note = ""
                if check:
                    out = [np.asarray(x, np.float32) for x in f(*args, *extra)]
                    if plain_out is None:
                        plain_out = out
                    else:
                        note = "vs plain rel-RMS o/final/ckpt " + "/".join(
                            f"{rel_rms(a, b):.1e}" for a, b in zip(out, plain_out))
                t = jax_time(f, *args, *extra, reps=5 if interpret else 20)
                rec.add(op=kind, implementation=impl if name == "plain" else f"{impl}:{name}", shape=label,
                        rows=list(lengths), checkpoints=mode, num_checkpoints=int(offsets.size), dtype="bf16",
                        note=note, **t)
            attempt(rec, run, op=kind, implementation=f"{impl}:{name}", shape=label, checkpoints=mode)
        rec.write()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", default=["gdn", "kda"])
    parser.add_argument("--shapes", nargs="*", default=None, help="B,T,H triples, e.g. 1,32768,16")
    parser.add_argument("--modes", nargs="+", default=["none", "per_row"], help="also: every_1024")
    parser.add_argument("--variants", nargs="+", default=["default", "L4096"], choices=sorted(VARIANTS))
    parser.add_argument("--deadline-s", type=float, default=540.0,
                        help="skip configurations that would start later than this (the JSON keeps what ran)")
    parser.add_argument("--peers", nargs="*", default=[], help="fla jla")
    parser.add_argument("--no-check", action="store_true", help="skip the comparison against the plain kernel")
    parser.add_argument("--name", default="sequence_parallel")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (interpret mode, tiny shapes)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.deadline_s
    rec = Recorder(args.name, out_dir())
    D = 16 if args.tiny else 128
    shapes = TINY_SHAPES if args.tiny else LONG_SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    variants = args.variants
    if args.tiny:
        VARIANTS.update({"L128": {"piece_len": 128}})
        variants = ["default", "L128"]
    for kind in args.ops:
        for B, T, H in shapes:
            label = {"B": B, "T": T, "H": H, "K": D, "V": D}
            print(f"== {kind} {label}", flush=True)
            bench_shape(rec, kind, [T] * B, H, D, label, args.modes, variants, args.tiny, not args.no_check,
                        deadline)
            for peer, runner in (("fla", lambda: bench_fla_delta(rec, kind, [T] * B, H, D, label, True)),
                                 ("jla", lambda: bench_jla_delta(rec, kind, "mosaic_gpu", [T] * B, H, D, label))):
                if peer in args.peers and time.monotonic() < deadline:
                    attempt(rec, runner, op=kind, implementation=peer, shape=label, checkpoints="none")
            rec.write()
    print(f"wrote {rec.write()}")


if __name__ == "__main__":
    main()
