"""In-chunk vs forced-break vs split-at-checkpoint export on the same inputs (any backend; the XLA path).

`python -m bench.checkpoint_methods [--T 4096 --H 4 --D 64]` writes checkpoint_methods.json/.md under $OUT or
bench/results. One row of T tokens with one checkpoint every 512 tokens, an fp32 initial state.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.cases import checkpoint_lists, delta_inputs
from bench.common import Recorder, jax_time, out_dir
from jaxckpt import ops


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--D", type=int, default=64)
    parser.add_argument("--name", default="checkpoint_methods")
    args = parser.parse_args(argv)
    rec = Recorder(args.name, out_dir())
    lengths = [args.T]
    ccu = np.array([0, len(range(512, args.T, 512))], np.int32)
    offsets = np.arange(512, args.T, 512, dtype=np.int32)
    shape = {"B": 1, "T": args.T, "H": args.H, "K": args.D, "V": args.D}
    for kind, fn in (("gdn", ops.gated_delta_rule), ("kda", ops.kda)):
        q, k, v, g, beta, h0, cu = delta_inputs(lengths, args.H, args.D, kind)
        arrays = [jnp.asarray(a) for a in (q, k, v, g, beta, h0)]
        none_ccu, none_offsets = checkpoint_lists(lengths, "none")
        for method, (c, o) in (("none", (none_ccu, none_offsets)), ("in_chunk", (ccu, offsets)),
                               ("forced_break", (ccu, offsets))):
            f = jax.jit(lambda q, k, v, g, beta, h0, c, o, method=method: fn(
                q, k, v, g, beta, initial_state=h0, cu_seqlens=jnp.asarray(cu), checkpoint_cu=c,
                checkpoint_offsets=o, implementation="xla",
                checkpoint_method="in_chunk" if method == "none" else method))
            rec.add(op=kind, implementation=f"xla/{method}", shape=shape, checkpoints=int(o.size), dtype="fp32",
                    **jax_time(f, *arrays, jnp.asarray(c), jnp.asarray(o), reps=5))
        # split-at-checkpoint plans on the host: launch j runs segment j; timed as the public call makes it
        split = lambda: fn(*arrays[:5], initial_state=arrays[5], cu_seqlens=cu, checkpoint_cu=ccu,  # noqa: E731
                           checkpoint_offsets=offsets, implementation="xla", checkpoint_method="split")
        rec.add(op=kind, implementation="xla/split", shape=shape, checkpoints=int(offsets.size), dtype="fp32",
                **jax_time(lambda *_: split(), reps=3))
    print(f"wrote {rec.write()}")


if __name__ == "__main__":
    main()
