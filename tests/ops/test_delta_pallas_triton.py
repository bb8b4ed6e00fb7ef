"""The Pallas Triton GDN and KDA kernels, run in interpret mode on CPU, against the float64 token-by-token references;
checkpoints leave outputs and final states bitwise unchanged; unsupported calls name their reason. KDA's intra pass
(and its `kda_block_k`) under strong per-channel decays and on a few of the shared vectors.

Interpret mode evaluates every dot in fp32 (TF32 does not apply), so fp32 inputs land at rel-RMS ~1e-7 against the
float64 references; FP32_TOL leaves two orders of magnitude of room.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxckpt.ops.common.log_decay import floor_log_decay, split_cumsum
from jaxckpt.ops.common.pallas_triton_tiles import Cumsum, Dots
from jaxckpt.ops.delta_rule import pallas_triton, reference
from tests.numerics import rel_rms
from tests.ops.varlen_case import CHECKPOINT_CU, CHECKPOINT_OFFSETS, CU_SEQLENS, NUM_TOKENS

pytestmark = pytest.mark.interpret

FP32_TOL = 1e-5
BF16_TOL = 1e-2

ROWS_WITH_STATE = (0, 2, 4)


def make_inputs(rng, num_tokens, num_heads, num_v_heads, head_k, head_v, *, per_channel):
    g_shape = (num_tokens, num_v_heads, head_k) if per_channel else (num_tokens, num_v_heads)
    # mostly mild decays with a few strong ones: exp(G_i - G_j) above the diagonal would overflow unless masked first
    g = -rng.exponential(0.3, size=g_shape) - np.where(rng.random(g_shape) < 0.05, 4.0, 0.0)
    return dict(q=rng.normal(size=(num_tokens, num_heads, head_k)).astype(np.float32),
                k=rng.normal(size=(num_tokens, num_heads, head_k)).astype(np.float32),
                v=rng.normal(size=(num_tokens, num_v_heads, head_v)).astype(np.float32),
                g=g.astype(np.float32),
                beta=rng.uniform(0.05, 0.95, size=(num_tokens, num_v_heads)).astype(np.float32))


def make_initial_state(rng, num_v_heads, head_k, head_v, layout):
    num_rows = CU_SEQLENS.size - 1
    shape = (num_rows, num_v_heads, head_k, head_v) if layout == "kv" else (num_rows, num_v_heads, head_v, head_k)
    state = rng.normal(size=shape).astype(np.float32)
    state[[n for n in range(num_rows) if n not in ROWS_WITH_STATE]] = 0.0
    return state


def varlen_options(initial_state, layout):
    return dict(initial_state=initial_state, cu_seqlens=CU_SEQLENS, checkpoint_cu=CHECKPOINT_CU,
                checkpoint_offsets=CHECKPOINT_OFFSETS, state_layout=layout)


def run(op, inputs, **options):
    arrays = {name: jnp.asarray(x) for name, x in inputs.items()}
    options = {name: jnp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in options.items()}
    return [np.asarray(x) for x in op(**arrays, **options, interpret=True)]


def assert_matches(actual, expected, tol):
    for name, a, e in zip(("o", "final_state", "checkpoint_states"), actual, expected):
        assert a.shape == e.shape, name
        assert not np.isnan(a).any(), name
        assert rel_rms(a, e) <= tol, (name, rel_rms(a, e))


@pytest.mark.parametrize("chunk_size, heads, head_k, head_v, layout, tuning", [
    (16, (1, 2), 16, 32, "kv", dict(fuse_output=True)),
    (64, (2, 4), 32, 16, "vk", dict()),
    (32, (1, 2), 16, 16, "kv", dict()),
    (32, (2, 2), 32, 16, "kv", dict(fuse_output=True, block_v=16)),
    (16, (1, 2), 16, 32, "kv", dict(block_v=16)),  # two V blocks: each stores and exports its own columns
])
def test_gdn_matches_reference(chunk_size, heads, head_k, head_v, layout, tuning):
    rng = np.random.default_rng(11 + chunk_size)
    inputs = make_inputs(rng, NUM_TOKENS, *heads, head_k, head_v, per_channel=False)
    options = dict(varlen_options(make_initial_state(rng, heads[1], head_k, head_v, layout), layout),
                   use_qk_l2norm=True)
    actual = run(pallas_triton.gated_delta_rule, inputs, **options, chunk_size=chunk_size, **tuning)
    assert_matches(actual, reference.gated_delta_rule(**inputs, **options), FP32_TOL)


@pytest.mark.parametrize("chunk_size, head_k, head_v, layout, gate, tuning", [
    (32, 16, 32, "kv", "softplus", dict(fuse_output=True)),
    (64, 32, 16, "vk", "bounded", dict()),
    (16, 16, 16, "kv", "softplus", dict()),
    (16, 16, 32, "vk", "bounded", dict(fuse_output=True)),
])
def test_kda_matches_reference(chunk_size, head_k, head_v, layout, gate, tuning):
    rng = np.random.default_rng(23 + chunk_size)
    inputs = make_inputs(rng, NUM_TOKENS, 1, 2, head_k, head_v, per_channel=True)
    gate_options = dict(A_log=rng.uniform(-1.0, 1.0, size=2).astype(np.float32),
                        dt_bias=rng.normal(size=2 * head_k).astype(np.float32))
    if gate == "softplus":
        inputs["g"] = rng.normal(size=inputs["g"].shape).astype(np.float32)
    else:
        gate_options = dict(gate_options, lower_bound=-5.0)
        inputs["g"] = (3.0 * rng.normal(size=inputs["g"].shape)).astype(np.float32)
    options = dict(varlen_options(make_initial_state(rng, 2, head_k, head_v, layout), layout), use_qk_l2norm=True)
    actual = run(pallas_triton.kda, inputs, **options, **gate_options, chunk_size=chunk_size, **tuning)
    assert_matches(actual, reference.kda(**inputs, **options, **gate_options), FP32_TOL)


@pytest.mark.parametrize("op, per_channel, tuning", [
    (pallas_triton.gated_delta_rule, False, dict()),
    (pallas_triton.kda, True, dict()),
    (pallas_triton.gated_delta_rule, False, dict(fuse_output=True)),
    (pallas_triton.kda, True, dict(fuse_output=True)),
])
def test_checkpoints_leave_outputs_bitwise_unchanged(op, per_channel, tuning):
    rng = np.random.default_rng(37 + per_channel)
    inputs = make_inputs(rng, NUM_TOKENS, 1, 2, 16, 16, per_channel=per_channel)
    initial_state = make_initial_state(rng, 2, 16, 16, "kv")
    with_checkpoints = run(op, inputs, **varlen_options(initial_state, "kv"), chunk_size=32, **tuning)
    without = run(op, inputs, initial_state=initial_state, cu_seqlens=CU_SEQLENS, chunk_size=32, **tuning)
    np.testing.assert_array_equal(with_checkpoints[0], without[0])
    np.testing.assert_array_equal(with_checkpoints[1], without[1])
    assert without[2].shape == (0, 2, 16, 16)


@pytest.mark.parametrize("tuning", [dict(), dict(fuse_output=True)])
def test_gdn_bfloat16_one_row_without_initial_state(tuning):
    rng = np.random.default_rng(41)
    inputs = make_inputs(rng, 100, 1, 2, 32, 32, per_channel=False)
    for name in ("q", "k", "v"):
        inputs[name] = inputs[name].astype(ml_dtypes.bfloat16)
    options = dict(checkpoint_cu=np.array([0, 3], np.int32), checkpoint_offsets=np.array([1, 64, 99], np.int32),
                   use_qk_l2norm=True)
    actual = run(pallas_triton.gated_delta_rule, inputs, **options, chunk_size=64, **tuning)
    assert actual[0].dtype == jnp.bfloat16 and actual[1].dtype == np.float32
    assert_matches(actual, reference.gated_delta_rule(**inputs, **options), BF16_TOL)


def test_supports_names_the_reason():
    rng = np.random.default_rng(43)
    inputs = {name: jnp.asarray(x) for name, x in make_inputs(rng, 8, 1, 1, 32, 32, per_channel=False).items()}
    assert pallas_triton.supports(**inputs, interpret=True) is None
    assert "chunk_size" in pallas_triton.supports(**inputs, chunk_size=128, interpret=True)
    assert "block_v" in pallas_triton.supports(**inputs, interpret=True, block_v=48)
    assert "unknown" in pallas_triton.supports(**inputs, interpret=True, num_warp=4)
    odd = dict(inputs, v=jnp.zeros((8, 1, 24), jnp.float32))
    assert pallas_triton.supports(**odd, interpret=True).startswith("V:")
    assert pallas_triton.supports(**dict(inputs, g=inputs["g"][..., None]), interpret=True).startswith("g:")
    with pytest.raises(ValueError, match="^g:"):
        pallas_triton.kda(**inputs, interpret=True)
    with pytest.raises(ValueError, match="^chunk_size"):
        pallas_triton.gated_delta_rule(**inputs, chunk_size=8, interpret=True)


def test_diagonal_block_helpers_are_exact_under_strong_decays():
    # the loop-free diagonal helpers, outside a kernel, against float64: decays down to e^-60 per token
    # would overflow any single-reference factorisation, the split one keeps every factor <= 1
    rng = np.random.default_rng(47)
    sub, head_k = pallas_triton.SUB, 32
    g = -rng.exponential(2.0, size=(sub, head_k)) - np.where(rng.random((sub, head_k)) < 0.2, 60.0, 0.0)
    G = np.cumsum(g, axis=0)
    a, k = rng.normal(size=(2, sub, head_k))
    pairs = a[:, None, :] * k[None, :, :] * np.exp(np.minimum(G[:, None, :] - G[None, :, :], 0.0))
    expected = np.where(np.tri(sub, k=-1, dtype=bool), pairs.sum(-1), 0.0)
    dots = Dots(jnp.float32)
    whole = Cumsum(jnp.asarray(G, jnp.float32))
    split = Cumsum(*split_cumsum(floor_log_decay(jnp.asarray(g, jnp.float32)), axis=0))
    for G32 in (whole, split):
        (scores,) = pallas_triton._diag_block_scores([jnp.asarray(a, jnp.float32)],
                                                           jnp.asarray(k, jnp.float32), G32,
                                                           lambda idx: G32.map(lambda x: x[idx]), dots)
        np.testing.assert_allclose(np.asarray(scores), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())

    A = np.tril(rng.normal(scale=0.3, size=(sub, sub)), k=-1)
    inverse = pallas_triton._doubling_inverse(jnp.asarray(A, jnp.float32))
    np.testing.assert_allclose(np.asarray(inverse), np.linalg.inv(np.eye(sub) + A), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_channel, split, dtype", [(False, False, np.float32), (True, False, ml_dtypes.bfloat16),
                                                        (True, True, np.float32)])
def test_gate_cumsum_floors_in_the_kernel(per_channel, split, dtype):
    # the launch takes the raw gate (any float dtype) and floors it as it loads it: -inf and very strong decays
    # become LOG_DECAY_FLOOR, a NaN stays NaN from its token on (a select, not the NaN-dropping max of the lowering)
    from jaxckpt.ops.common.log_decay import LOG_DECAY_FLOOR
    from jaxckpt.ops.delta_rule import cumsum
    from jaxckpt.plan.layout import chunk_layout

    rng = np.random.default_rng()
    chunk, lengths, heads, head_k = 16, [21, 16, 9], 2, 8
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    shape = (int(cu[-1]), heads, head_k) if per_channel else (int(cu[-1]), heads)
    g = (-rng.exponential(1.0, size=shape)).astype(dtype)
    g[3], g[17], g[30] = -np.inf, -500.0, np.nan
    lay = chunk_layout(jnp.asarray(cu), jnp.zeros(len(lengths) + 1, jnp.int32), jnp.zeros(0, jnp.int32),
                       chunk_size=chunk, num_tokens=g.shape[0], xp=jnp)
    G = cumsum.gate_cumsum(lay.chunk_start, lay.chunk_len, jnp.asarray(g), per_channel_decay=per_channel,
                           chunk=chunk, split=split, interpret=True)
    G = np.asarray(G[0] + G[1] if split else G, np.float64)
    floored = np.where(g.astype(np.float64) < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, g.astype(np.float64))
    for c, (start, length) in enumerate(zip(np.asarray(lay.chunk_start), np.asarray(lay.chunk_len))):
        expected = np.cumsum(floored[start:start + length], axis=0)  # [length, HV(, K)]
        actual = np.moveaxis(G[:, c, :length], 0, 1)
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-4, equal_nan=True)
        assert np.isnan(actual).any() == (start <= 30 < start + length)


# KDA's intra pass (and `kda_block_k`):
# rows of 0, 1, 36, 0 and 83 tokens plus padding, checkpoints at sub-chunk boundaries (16, 32, 48, 80), at the chunk
# boundary 64, inside sub-chunks and at len - 1, then two padded CSR entries
KDA_CHECKPOINT_CU = np.array([0, 0, 0, 3, 3, 9], np.int32)
KDA_CHECKPOINT_OFFSETS = np.array([16, 32, 35, 1, 15, 16, 48, 64, 80, 0, 0], np.int32)


def strong_kda_inputs(rng, gate, head_k, head_v):
    """KDA inputs with strong per-channel decays, and the gate options that produce them.

    "uniform5": log decay g ~ U(-5, 0) per token and channel; "spikes": mild decays with 10% of -30 spikes (exp(-G)
    reaches e^180 within a chunk, so any unrebased factor overflows fp32 and underflowing factors are the rule);
    "lower_bound": FLA's safe gate at its bound -5 with A_log; "softplus": Kimi-Linear's gate
    -exp(A_log) softplus(g + dt_bias) with exp(A_log) up to e^1.5.
    """
    inputs = make_inputs(rng, NUM_TOKENS, 1, 2, head_k, head_v, per_channel=True)
    shape = inputs["g"].shape
    options = {}
    if gate == "uniform5":
        inputs["g"] = rng.uniform(-5.0, 0.0, size=shape)
    elif gate == "spikes":
        inputs["g"] = -rng.exponential(0.5, size=shape) - np.where(rng.random(shape) < 0.1, 30.0, 0.0)
    else:
        inputs["g"] = 3.0 * rng.normal(size=shape)
        options = dict(A_log=rng.uniform(0.5, 1.5, size=2).astype(np.float32),
                       dt_bias=rng.normal(size=(2, head_k)).astype(np.float32))
        if gate == "lower_bound":
            options["lower_bound"] = -5.0
    inputs["g"] = inputs["g"].astype(np.float32)
    return inputs, options


def kda_varlen_options(rng, head_k, head_v, layout):
    return dict(initial_state=make_initial_state(rng, 2, head_k, head_v, layout), cu_seqlens=CU_SEQLENS,
                checkpoint_cu=KDA_CHECKPOINT_CU, checkpoint_offsets=KDA_CHECKPOINT_OFFSETS, state_layout=layout,
                use_qk_l2norm=True)


def assert_finite_matches(actual, expected, tol):
    for a in actual:
        assert np.isfinite(a).all()
    assert_matches(actual, expected, tol)


@pytest.mark.parametrize("chunk_size, head_k, head_v, layout, gate, tuning", [
    (64, 32, 32, "kv", "uniform5", dict()),
    (64, 64, 32, "vk", "spikes", dict(kda_block_k=16)),
    (32, 32, 64, "kv", "lower_bound", dict(fuse_output=True)),
    (16, 32, 32, "kv", "softplus", dict(kda_block_k=16)),
    (64, 32, 32, "kv", "spikes", dict()),
])
def test_kda_intra_matches_reference_under_strong_decays(chunk_size, head_k, head_v, layout, gate, tuning):
    rng = np.random.default_rng(53 + chunk_size + head_k)
    inputs, gate_options = strong_kda_inputs(rng, gate, head_k, head_v)
    options = dict(kda_varlen_options(rng, head_k, head_v, layout), **gate_options)
    actual = run(pallas_triton.kda, inputs, **options, chunk_size=chunk_size, **tuning)
    assert_finite_matches(actual, reference.kda(**inputs, **options), FP32_TOL)


def test_kda_bfloat16_intra():
    rng = np.random.default_rng(61)
    inputs, gate_options = strong_kda_inputs(rng, "lower_bound", 32, 32)
    for name in ("q", "k", "v"):
        inputs[name] = inputs[name].astype(ml_dtypes.bfloat16)
    options = dict(kda_varlen_options(rng, 32, 32, "kv"), **gate_options)
    actual = run(pallas_triton.kda, inputs, **options, chunk_size=64)
    assert actual[0].dtype == jnp.bfloat16 and actual[1].dtype == np.float32
    assert_finite_matches(actual, reference.kda(**inputs, **options), BF16_TOL)


def test_kda_supports_names_bad_intra_options():
    rng = np.random.default_rng(67)
    inputs = {name: jnp.asarray(x) for name, x in make_inputs(rng, 8, 1, 1, 32, 64, per_channel=True).items()}
    assert pallas_triton.supports(**inputs, interpret=True, kda_block_k=16) is None
    for bad in (8, 48, 64):  # below a tile, not a power of two, above min(K, V) = 32
        assert "kda_block_k" in pallas_triton.supports(**inputs, interpret=True, kda_block_k=bad)


# the shared vectors' strong-decay, chunk-edge and bf16 safe-gate KDA cases (interpret mode compiles every shape anew,
# ~5 s each; all 11 cases pass)
KDA_VECTOR_CASES = ("tiny_rows_fused_gate", "chunk_edges_log_gate", "lower_bound_gate", "bf16_lower_bound_vk")


@pytest.mark.parametrize("name", KDA_VECTOR_CASES)
def test_kda_intra_matches_shared_vectors(name):
    from tests.vectors.loader import check_case, load_case

    case = load_case("kda", name)
    args = case.arguments
    assert pallas_triton.supports(*(args[arg] for arg in ("q", "k", "v", "g", "beta")), interpret=True) is None
    check_case(case, [np.asarray(x) for x in pallas_triton.kda(**args, interpret=True)])
