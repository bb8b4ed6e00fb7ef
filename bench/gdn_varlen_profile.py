"""Where the GDN varlen mix (`ops_bench.VARLEN_MIX`: 8 rows, 32768 tokens, 16 heads, K = V = 128, an initial state
per row) spends its time under `implementation="pallas_mosaic_gpu"` with a few kernel options: wall time and device
time per kernel (`results/gdn_varlen_profile_h200.log`). `python -m bench.gdn_varlen_profile` on the GPU machine.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import jax_time, kernel_times  # noqa: E402
from bench.ops_bench import VARLEN_MIX, delta_inputs  # noqa: E402

OPTIONS = ({}, {"intra": "mosaic_gpu"}, {"intra": "mosaic_gpu", "pieces": 1}, {"intra": "mosaic_gpu", "pieces": 2})


def main():
    import jax
    import jax.numpy as jnp

    from jaxckpt import ops

    q, k, v, g, beta, h0, cu = delta_inputs(VARLEN_MIX, 16, 128, "gdn")
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    args = (bf(q), bf(k), bf(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(h0), jnp.asarray(cu))
    for options in OPTIONS:
        f = jax.jit(lambda q, k, v, g, b, h0, cu, options=options: ops.gated_delta_rule(
            q, k, v, g, b, initial_state=h0, cu_seqlens=cu, implementation="pallas_mosaic_gpu",
            kernel_options=options))
        wall = jax_time(f, *args)["median_ms"]
        kernels, device = kernel_times(f, args, reps=5)
        print(json.dumps(dict(opts=options, wall=wall, device=device,
                              kernels={name: round(ms, 4) for name, ms in list(kernels.items())[:10]})), flush=True)


if __name__ == "__main__":
    main()
