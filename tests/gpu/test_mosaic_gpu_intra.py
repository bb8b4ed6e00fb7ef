"""The Mosaic GPU GDN intra-chunk kernel at a real shape on an H100/H200: against the Triton `_intra_kernel_v2` and
float64, output by output, with varlen rows (unaligned chunk starts, partial last chunks, the last TMA window past T).

Run on the GPU machine: `JAXCKPT_GPU_TESTS=1 JAX_PLATFORMS=cuda python -m pytest -q tests/gpu/test_mosaic_gpu_intra.py`.
"""

import pytest

from tests.gpu.mosaic_cases import CU_SEQLENS, NUM_TOKENS

pytestmark = pytest.mark.gpu


FIRST = dict(inverse="split", chunks_per_cta=1, landing="rows")  # the kernel's first version


@pytest.mark.parametrize("dtype, num_heads, group, tol, tuning", [
    ("bfloat16", 4, 1, 6e-3, {}),  # the bf16 class of the shared vectors
    ("bfloat16", 4, 1, 6e-3, FIRST),
    ("bfloat16", 2, 2, 6e-3, dict(inverse="f16", chunks_per_cta=4)),
    # 131 chunks: the last CTA walks 2 of its 3
    ("bfloat16", 4, 1, 6e-3, dict(inverse="split", chunks_per_cta=3, landing="rows")),
    ("float16", 4, 1, 2e-3, dict(inverse="f16", chunks_per_cta=8)),
    ("float32", 4, 1, 3e-5, {}),   # the precise path: split-bf16 products, not TF32
    # the substitution for T's 16 x 16 diagonal blocks (Mosaic GPU code: it runs only here, the interpreter doubles)
    ("bfloat16", 4, 1, 6e-3, dict(inverse="blocked")),
    ("bfloat16", 2, 2, 6e-3, dict(inverse="blocked", landing="rows")),
    ("float16", 4, 1, 2e-3, dict(inverse="blocked")),
    # raw near-parallel keys over six (bf16) or three (fp16) decades of norm: the scaled inverse, on the tensor cores
    ("bfloat16", 4, 1, 6e-3, dict(raw=(1e-3, 1e3))),
    ("float16", 4, 1, 2e-3, dict(raw=(0.015, 60.0))),
])
def test_real_shape_against_triton_and_float64(dtype, num_heads, group, tol, tuning):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import intra as mgi
    from tests.ops.test_pallas_mosaic_gpu_intra import check_outputs, run_both

    assert jax.default_backend() == "gpu"
    q = jnp.zeros((NUM_TOKENS, num_heads, 128), dtype)
    v = jnp.zeros((NUM_TOKENS, num_heads * group, 128), dtype)
    reason = mgi.supports(q, q, v, v[..., 0], jnp.zeros((num_heads * group, 1, 64)))
    if reason is not None:
        pytest.skip(reason)
    seed = 20261130
    outputs = run_both(seed, jnp.dtype(dtype), num_heads, group, 128, 128, cu_seqlens=CU_SEQLENS,
                       num_tokens=NUM_TOKENS, interpret=False, **tuning)
    check_outputs(seed, dtype, *outputs, tol=tol)
    mosaic, triton = outputs[:2]
    for name, m, t in zip(("w", "u", "kd", "qg", "aqk"), mosaic, triton):
        m, t = np.asarray(m, np.float64), np.asarray(t, np.float64)
        print(f"{dtype} H {num_heads} group {group} {tuning} {name}: rel-RMS vs triton "
              f"{np.linalg.norm(m - t) / np.linalg.norm(t):.2e}")
