"""Inputs and measures shared by the Mosaic GPU tests that run on the GPU machine (tests/gpu/test_*mosaic_gpu*.py).

Not a test module: it only builds inputs, so it imports jax lazily and collecting tests/gpu stays cheap where the
tests are skipped.
"""

import numpy as np

BF16_TOL = 6e-3  # tests/vectors/loader.py's "bf16" class (rel-RMS)
# varlen rows at a real size: rows starting off the 8-row TMA tile grid (3000, 3001), a 1-token row, partial last
# chunks, then 2 padding tokens (the last TMA window runs past the rows)
CU_SEQLENS = (0, 3000, 3001, 8190)
NUM_TOKENS = 8192


def delta_inputs(op, rng, num_tokens, num_rows, *, heads, group=1, dim=128, long_memory=False):
    """(bf16 [q, k, v], fp32 g, beta, initial states) for GDN (`op` "gdn") or KDA ("kda"): q, k [T, H, D]
    l2-normalized per token, v [T, HV, D] with HV = heads x group, softplus-style log decays g [T, HV] (KDA:
    [T, HV, D], divided by 8), sigmoid beta [T, HV], initial states [num_rows, HV, D, D] x 0.1.

    `long_memory`: log decays ~ -1e-4 per token and beta in (0.005, 0.05) instead, so a state still matters
    thousands of tokens later (with the softplus gates it is forgotten within a few chunks).
    """
    import jax.numpy as jnp

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    T, H, HV, D = num_tokens, heads, heads * group, dim
    q, k = (unit(rng.standard_normal((T, H, D))).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((T, HV, D)).astype(np.float32)
    g_shape = (T, HV) if op == "gdn" else (T, HV, D)
    g = -np.log1p(np.exp(-rng.standard_normal(g_shape))).astype(np.float32) / (1 if op == "gdn" else 8)
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, HV))))).astype(np.float32)
    if long_memory:
        g = -rng.exponential(1e-4, size=g_shape).astype(np.float32)
        beta = rng.uniform(0.005, 0.05, size=(T, HV)).astype(np.float32)
    h0 = (rng.standard_normal((num_rows, HV, D, D)) * 0.1).astype(np.float32)
    return [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)], g, beta, h0


def delta_case(op, rng, lengths, offsets, **options):
    """`delta_inputs` for rows of `lengths` tokens with per-row checkpoint `offsets`: (bf16 [q, k, v], g, beta,
    meta), meta holding cu_seqlens, the CSR checkpoint arrays and the initial states."""
    bf, g, beta, h0 = delta_inputs(op, rng, sum(lengths), len(lengths), **options)
    meta = dict(cu_seqlens=np.cumsum([0, *lengths]).astype(np.int32),
                checkpoint_cu=np.cumsum([0, *map(len, offsets)]).astype(np.int32),
                checkpoint_offsets=np.concatenate(offsets).astype(np.int32), initial_state=h0)
    return bf, g, beta, meta


def entries(op):
    """(the public entry, the float64 reference) of GDN or KDA."""
    from jaxckpt import ops
    from jaxckpt.ops.delta_rule.reference import gated_delta_rule as gdn_ref
    from jaxckpt.ops.delta_rule.reference import kda as kda_ref

    return (ops.gated_delta_rule, gdn_ref) if op == "gdn" else (ops.kda, kda_ref)
