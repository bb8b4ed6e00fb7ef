"""The fused GDN pass with the sequence split (`kernel_options={"state": "fused", "pieces": P}`): wall and device
time per kernel against state "v1" and "v2" (both with the Mosaic GPU intra pass), on one Hopper GPU.

GPU: `python -m bench.mosaic_gpu_fused_split_quick [--rows 1] [--tokens 8192 32768] [--heads 16]
[--pieces 1 2 4 8 auto] [--checkpoints 0]`.
Inputs and printout as `bench.mosaic_gpu_split_quick` (K = V = 128, bf16 q, k, v l2-normalized in the op, an fp32
initial state per row; per variant the median wall ms, the summed device ms per call and the device ms of each
kernel: the fused path shows as gdn_kkt_mosaic_gpu, gdn_fused_lanes_map and gdn_fused_lanes next to the cumsum
launch), and the rel-RMS of o, final state and checkpoints against state v1.
`--interpret` is a CPU dry run at tiny sizes (e.g. `--tokens 256 --heads 2 --dim 64 --pieces 1 2`), not a
measurement.
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="tokens per row")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--pieces", nargs="+", default=["1", "2", "4", "8", "auto"])
    parser.add_argument("--checkpoints", type=int, default=0, help="per row, evenly spaced")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--interpret", action="store_true")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from bench.mosaic_gpu_split_quick import checkpoint_meta, make_inputs, print_variants
    from jaxckpt.ops.common.pallas_mosaic_gpu_split import choose_pieces
    from jaxckpt.ops.gdn.pallas_mosaic_gpu import gated_delta_rule

    print(f"devices: {jax.devices()}")
    pieces = [p if p == "auto" else int(p) for p in args.pieces]
    variants = {"v1": {"intra": "mosaic_gpu", "state": "v1"},
                "v2 pieces=auto": {"intra": "mosaic_gpu", "state": "v2", "pieces": "auto"}}
    variants.update({f"fused pieces={p}": {"state": "fused", "pieces": p} for p in pieces})
    rng = np.random.default_rng(0)
    for rows in args.rows:
        for length in args.tokens:
            T = rows * length
            inputs = make_inputs(rng, "gdn", T, args.heads, args.dim, rows)
            meta = dict(cu_seqlens=jnp.arange(rows + 1, dtype=jnp.int32) * length, interpret=args.interpret,
                        use_qk_l2norm=True, **checkpoint_meta(rows, length, args.checkpoints))
            arrays = [inputs[name] for name in ("q", "k", "v", "g", "beta", "initial_state")]
            label = f"gdn ({rows}, {length}, {args.heads}) K=V={args.dim} ckpts/row={args.checkpoints}"
            print(f"== {label}: choose_pieces -> {choose_pieces(rows, args.heads, args.dim, T)}", flush=True)
            fns = {name: jax.jit(functools.partial(
                lambda q, k, v, g, beta, h0, options: gated_delta_rule(q, k, v, g, beta, initial_state=h0, **meta,
                                                                       **options),
                options=options)) for name, options in variants.items()}
            print_variants(label, fns, arrays, reps=args.reps)


if __name__ == "__main__":
    main()
