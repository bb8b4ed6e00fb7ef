"""The Mosaic GPU KDA intra-chunk kernel at a real shape on an H100/H200: against the Triton KDA intra launches and
float64, output by output, with varlen rows (unaligned chunk starts, partial last chunks, the last TMA window past T).

Run on the GPU machine:
`JAXCKPT_GPU_TESTS=1 JAX_PLATFORMS=cuda python -m pytest -q -s tests/gpu/test_mosaic_gpu_kda_intra.py`.
"""

import pytest

from tests.gpu.mosaic_cases import CU_SEQLENS, NUM_TOKENS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, strong, tuning, tol", [
    ("bfloat16", False, {}, 6e-3),  # the default: score_parts 1, the fp16 inverse; the bf16 class of the vectors
    ("bfloat16", False, dict(score_parts=2, inverse="split"), 6e-3),
    ("bfloat16", True, {}, 6e-3),   # G far below -88 inside chunks: a naive factorisation would overflow
    ("float16", False, {}, 2e-3),
    ("float16", False, dict(inverse="split"), 2e-3),
    ("float32", False, {}, 3e-5),   # the precise path: split-bf16 products, not TF32
    # the substitution for T's 16 x 16 diagonal blocks (Mosaic GPU code: it runs only here, the interpreter doubles)
    ("bfloat16", False, dict(inverse="blocked"), 6e-3),
    ("bfloat16", True, dict(inverse="blocked"), 6e-3),
    ("float16", False, dict(inverse="blocked"), 2e-3),
    # raw near-parallel keys over six (bf16) or three (fp16) decades of norm: the scaled inverse, on the tensor cores
    ("bfloat16", False, dict(raw=(1e-3, 1e3)), 6e-3),
    ("float16", False, dict(raw=(0.015, 60.0)), 2e-3),
])
def test_real_shape_against_triton_and_float64(dtype, strong, tuning, tol):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import kda_intra as mki
    from tests.ops.test_pallas_mosaic_gpu_kda_intra import OUTPUTS, check_outputs, run_all

    assert jax.default_backend() == "gpu"
    dtype = jnp.dtype(dtype)
    num_heads, dim = 4, 128
    q = jnp.zeros((NUM_TOKENS, num_heads, dim), dtype)
    reason = mki.supports(q, q, q, q[..., 0], jnp.zeros((NUM_TOKENS, num_heads, dim)), num_chunks=1,
                          **{k: v for k, v in tuning.items() if k != "raw"})
    if reason is not None:
        pytest.skip(reason)
    seed = 20261130
    mosaic, triton, exact, chunk_len, _ = run_all(seed, dtype, num_heads, 1, dim, dim, cu_seqlens=CU_SEQLENS,
                                                  num_tokens=NUM_TOKENS, strong=strong, interpret=False, **tuning)
    errors = check_outputs(seed, dtype, mosaic, triton, exact, chunk_len, tol=tol)
    triton_errors = {name: np.linalg.norm(np.asarray(t, np.float64) - e) / np.linalg.norm(e)
                     for name, t, e in zip(OUTPUTS, triton, exact)}
    for name, (vs_exact, vs_triton) in errors.items():
        print(f"{dtype.name} strong {strong} {tuning} {name}: rel-RMS vs float64 {vs_exact:.2e} "
              f"(triton {triton_errors[name]:.2e}), vs triton {vs_triton:.2e}")
