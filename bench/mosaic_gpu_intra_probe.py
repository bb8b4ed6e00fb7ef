"""Where the GDN Mosaic GPU intra pass's time goes: its inverse chain and its KD / QG / AQK outputs.

GPU: `python -m bench.mosaic_gpu_intra_probe [T ...]` (default 8192; H 16, K = V = 128, bf16, one row). A diagnostic,
not a variant: each probe patches a private helper of `pallas_mosaic_gpu_intra` in this process only (the inverse
with fewer doubling levels or none; `_stage_out` skipping the named outputs), so the probes' outputs are wrong by
design and only their device times mean something. `xla_copy_same_bytes` is an XLA pass reading q, k, v and writing
as many bytes as the kernel's five outputs: the memory floor of the kernel's traffic.
"""
from __future__ import annotations

import functools
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from bench.common import time_call  # noqa: E402
from bench.mosaic_gpu_intra_quick import gate_cumsum, layout, make_inputs  # noqa: E402
from jaxckpt.ops.common import pallas_mosaic_gpu_intra as mi  # noqa: E402
from jaxckpt.ops.common import pallas_mosaic_gpu_tiles as tiles  # noqa: E402

orig_inverse, orig_stage = mi._inverse, mi._stage_out

def inverse_levels(first):
    def inv(A, t_buf, p_buf, lhs_buf=None, *, pad=None):  # pad: the "blocked" inverse's, unused here
        sq = (mi.CHUNK, mi.CHUNK)
        parts = t_buf.shape[0]
        lhs_buf = t_buf if lhs_buf is None else lhs_buf
        eye = jnp.where(tiles.iota(sq, 0) == tiles.iota(sq, 1), 1.0, 0.0)
        T = eye - jnp.where(tiles.half_pairs(1), A, 0.0)
        t_terms, p_terms = tuple(t_buf.at[p] for p in range(parts)), tuple(p_buf.at[p] for p in range(parts))
        s = first
        while s < mi.CHUNK:
            tiles.store_parts(t_buf, T, parts)
            tiles.store_parts(p_buf, jnp.where(tiles.half_pairs(s), A, 0.0), parts)
            plgpu.commit_smem()
            prod = mi._dot(p_terms, t_terms, sq)
            tiles.store_parts(p_buf, prod, parts)
            plgpu.commit_smem()
            T = T - mi._dot(t_terms, p_terms, sq)
            s *= 2
        tiles.store_parts(lhs_buf, T, lhs_buf.shape[0])
        plgpu.commit_smem()
        return tuple(lhs_buf.at[p] for p in range(lhs_buf.shape[0]))
    return inv

def stage_skipping(skip):
    count = [0]
    def stage(stages, x, dst):
        i = count[0] % 5  # call order in _intra_kernel: KD, AQK, QG, W, U
        count[0] += 1
        if i in skip:
            return
        orig_stage(stages, x, dst)
    return stage

PROBES = {
    "default": (orig_inverse, orig_stage),
    "levels_16_32": (inverse_levels(16), orig_stage),
    "no_inverse": (inverse_levels(64), orig_stage),
    "no_kd_qg": (orig_inverse, None),
    "levels_16_32_no_kd_qg": (inverse_levels(16), None),
    "no_kd_qg_aqk": (orig_inverse, "aqk"),
}

def main():
    tokens = [int(t) for t in sys.argv[1:]] or [8192]
    H, D = 16, 128
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
    for T in tokens:
        x = make_inputs(np.random.default_rng(0), T, H, H, D, D)
        q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
        beta = jnp.asarray(x["beta"], jnp.bfloat16)
        cs, cl = layout([0, T], T)
        G = jax.block_until_ready(gate_cumsum(cs, cl, jnp.asarray(x["g"])))
        for name, (inv, stage) in PROBES.items():
            mi._inverse = inv
            mi._stage_out = stage_skipping({0, 2}) if stage is None else (stage_skipping({0, 1, 2}) if stage == "aqk" else stage)
            fn = jax.jit(functools.partial(mi.gdn_intra, chunk=64, group=1, scale=D ** -0.5))
            _, wall, kernels, total = time_call(fn, (cs, cl, q, k, v, beta, G), warmup=5, reps=20)
            print(f"T {T} {name}: wall {wall:.3f} device {total:.3f} " + ", ".join(f"{k_} {ms:.3f}" for k_, ms in sorted(kernels.items())), flush=True)
        mi._inverse, mi._stage_out = orig_inverse, orig_stage
        copy = jax.jit(lambda q, k, v: (q * 1.5, k * 1.5, v * 1.5, q + k, (q[..., :64] * 2)))
        _, wall, kernels, total = time_call(copy, (q, k, v), warmup=5, reps=20)
        print(f"T {T} xla_copy_same_bytes: wall {wall:.3f} device {total:.3f}", flush=True)

if __name__ == "__main__":
    main()
