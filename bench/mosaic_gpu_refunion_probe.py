"""A check behind the Mosaic GPU SSD token layout (`jaxckpt/ops/ssd/pallas_mosaic_gpu.py`, "Token layout"): a TMA into
an untiled 128-byte-swizzled [64, 64] bf16 tile at a row off the 8-row grid, read back by a wgmma through the tiled
view of the same `plgpu.RefUnion`. On an H200, `python -m bench.mosaic_gpu_refunion_probe` prints that it lowers and
the GPU's error against numpy (`results/mosaic_gpu_refunion_probe_h200.log`). On CPU Mosaic GPU's interpreter keeps the
two views apart (the read gives NaN), which is why the kernel uses the tiled view under `interpret`.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

START = 13  # a row off the 8-row tile grid


def main():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from jaxckpt.ops.common import pallas_mosaic_gpu_tiles as tiles

    bf = jnp.bfloat16

    def kernel(x_ref, o_ref, union, bar):
        land, tiled = union
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(START, 64)], land, bar)
        plgpu.barrier_wait(bar)

        def body(acc):
            plgpu.wgmma(acc, tiled, tiled)
            return acc[...]

        o_ref[...] = pl.run_scoped(body, plgpu.ACC((64, 64), jnp.float32))

    union = plgpu.RefUnion(plgpu.SMEM((64, 64), bf, transforms=(plgpu.SwizzleTransform(128),)),
                           tiles.swizzled((64, 64), bf))
    probe = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                         scratch_types=[union, plgpu.Barrier()],
                         compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
    lowered = jax.export.export(jax.jit(probe), platforms=["cuda"])(jax.ShapeDtypeStruct((200, 64), bf))
    print("lowered", len(lowered.mlir_module()))
    if jax.default_backend() == "gpu":
        x = jax.random.normal(jax.random.key(0), (200, 64)).astype(bf)
        rows = np.asarray(x[START:START + 64], np.float32)
        print("gpu err", float(np.abs(np.asarray(probe(x)) - rows @ rows).max()))


if __name__ == "__main__":
    main()
