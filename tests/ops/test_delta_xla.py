"""The chunk-parallel XLA GDN and KDA against the float64 token-by-token references, and their own promises:
checkpoint methods and state passes agree, in-chunk checkpoints leave outputs bitwise unchanged, traced metadata
compiles once, bf16 inputs land in the bf16 accuracy class, gradients match a token-by-token scan."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxckpt.ops.delta_rule import reference, xla
from jaxckpt.ops.delta_rule.gate import kda_gate
from tests.numerics import rel_rms
from tests.ops.varlen_case import CHECKPOINT_CU, CHECKPOINT_OFFSETS, CU_SEQLENS, NUM_TOKENS

H, HV = 2, 4
FP32_TOL = 1e-5
BF16_TOL = 6e-3


def make_inputs(rng, num_tokens, head_k, head_v, *, per_channel, dtype=np.float32):
    g_shape = (num_tokens, HV, head_k) if per_channel else (num_tokens, HV)
    # mostly mild decays with a few strong ones: exp(G_i - G_j) above the diagonal would overflow unless masked first
    g = -rng.exponential(0.3, size=g_shape) - np.where(rng.random(g_shape) < 0.05, 4.0, 0.0)
    return dict(q=rng.normal(size=(num_tokens, H, head_k)).astype(dtype),
                k=rng.normal(size=(num_tokens, H, head_k)).astype(dtype),
                v=rng.normal(size=(num_tokens, HV, head_v)).astype(dtype),
                g=g.astype(dtype),
                beta=rng.uniform(0.05, 0.95, size=(num_tokens, HV)).astype(dtype))


def make_initial_state(rng, num_rows, head_k, head_v, layout, *, rows_with_state):
    shape = (num_rows, HV, head_k, head_v) if layout == "kv" else (num_rows, HV, head_v, head_k)
    state = rng.normal(size=shape).astype(np.float32)
    state[[n for n in range(num_rows) if n not in rows_with_state]] = 0.0
    return state


def varlen_kwargs(initial_state, **options):
    return dict(initial_state=initial_state, cu_seqlens=CU_SEQLENS, checkpoint_cu=CHECKPOINT_CU,
                checkpoint_offsets=CHECKPOINT_OFFSETS, **options)


def assert_matches(actual, expected, tol):
    for name, a, e in zip(("o", "final_state", "checkpoint_states"), actual, expected):
        assert a.shape == e.shape, name
        assert rel_rms(a, e) <= tol, (name, rel_rms(a, e))


@pytest.mark.parametrize("chunk_size, state_layout", [(16, "kv"), (64, "vk")])
def test_gdn_matches_reference(chunk_size, state_layout):
    rng = np.random.default_rng(101)
    inputs = make_inputs(rng, NUM_TOKENS, 16, 32, per_channel=False)
    init = make_initial_state(rng, 5, 16, 32, state_layout, rows_with_state=(0, 2, 4))
    kwargs = varlen_kwargs(init, use_qk_l2norm=True, state_layout=state_layout)
    expected = reference.gated_delta_rule(**inputs, **kwargs)
    outs = [xla.gated_delta_rule(**inputs, **kwargs, chunk_size=chunk_size, checkpoint_method=method)
            for method in ("in_chunk", "forced_break")]
    for out in outs:
        assert out[0].dtype == jnp.float32 and out[1].dtype == out[2].dtype == jnp.float32
        assert_matches(out, expected, FP32_TOL)
        assert np.all(np.asarray(out[0])[CU_SEQLENS[-1]:] == 0)
        assert np.all(np.asarray(out[2])[CHECKPOINT_CU[-1]:] == 0)
    assert_matches(outs[0], outs[1], FP32_TOL)


# chunk 12 is not a multiple of the KDA score sub-block (8): the whole chunk is one exact pairwise block
@pytest.mark.parametrize("gate, chunk_size, methods", [
    ("log_decay", 16, ("in_chunk", "forced_break")), ("a_log", 64, ("in_chunk",)),
    ("bounded_a_log", 16, ("forced_break",)), ("bounded", 12, ("in_chunk",))])
def test_kda_matches_reference(gate, chunk_size, methods):
    rng = np.random.default_rng(202)
    inputs = make_inputs(rng, NUM_TOKENS, 32, 16, per_channel=True)
    gate_kwargs = dict(
        log_decay={},
        a_log=dict(A_log=rng.uniform(-1.0, 1.0, HV).astype(np.float32),
                   dt_bias=rng.normal(size=HV * 32).astype(np.float32)),
        bounded_a_log=dict(A_log=rng.uniform(-1.0, 1.0, HV).astype(np.float32),
                           dt_bias=rng.normal(size=(HV, 32)).astype(np.float32), lower_bound=-5.0),
        bounded=dict(lower_bound=-2.0),
    )[gate]
    if gate != "log_decay":
        inputs["g"] = rng.normal(size=inputs["g"].shape).astype(np.float32)
    state_layout = "vk" if chunk_size == 64 else "kv"
    init = make_initial_state(rng, 5, 32, 16, state_layout, rows_with_state=(1, 2))
    kwargs = varlen_kwargs(init, use_qk_l2norm=True, state_layout=state_layout, **gate_kwargs)
    expected = reference.kda(**inputs, **kwargs)
    outs = [xla.kda(**inputs, **kwargs, chunk_size=chunk_size, checkpoint_method=method) for method in methods]
    for out in outs:
        assert_matches(out, expected, FP32_TOL)
    assert_matches(outs[0], outs[-1], FP32_TOL)
    np.testing.assert_allclose(kda_gate(jnp.asarray(inputs["g"]), **gate_kwargs),
                               reference.kda_gate(inputs["g"], **gate_kwargs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("per_channel", [False, True])
def test_in_chunk_checkpoints_leave_outputs_bitwise_unchanged(per_channel):
    rng = np.random.default_rng(404)
    inputs = make_inputs(rng, NUM_TOKENS, 16, 32, per_channel=per_channel)
    inputs["k"] *= 0.25  # without the normalisation, keeps beta |k|^2 near 1
    init = make_initial_state(rng, 5, 16, 32, "kv", rows_with_state=(0, 1, 4))
    op, ref = (xla.kda, reference.kda) if per_channel else (xla.gated_delta_rule,
                                                                      reference.gated_delta_rule)
    with_ckpt = op(**inputs, **varlen_kwargs(init, scale=0.3), chunk_size=16)
    without = op(**inputs, initial_state=init, cu_seqlens=CU_SEQLENS, scale=0.3, chunk_size=16)
    assert without[2].shape == (0, HV, 16, 32)
    np.testing.assert_array_equal(with_ckpt[0], without[0])
    np.testing.assert_array_equal(with_ckpt[1], without[1])
    assert_matches(with_ckpt, ref(**inputs, **varlen_kwargs(init, scale=0.3)), FP32_TOL)


def test_checkpoint_is_final_state_of_prefix_run():
    rng = np.random.default_rng(505)
    length, offsets = 100, np.array([1, 30, 64, 99], np.int32)
    inputs = make_inputs(rng, length, 16, 16, per_channel=True)
    init = make_initial_state(rng, 1, 16, 16, "vk", rows_with_state=(0,))
    _, _, checkpoints = xla.kda(**inputs, initial_state=init, checkpoint_cu=np.array([0, 4], np.int32),
                           checkpoint_offsets=offsets, use_qk_l2norm=True, state_layout="vk")
    # the prefixes packed as rows of one batch, each starting from the same initial state
    tokens = np.concatenate([np.arange(p) for p in offsets])
    prefix_inputs = {name: x[tokens] for name, x in inputs.items()}
    prefix_cu = np.concatenate([[0], np.cumsum(offsets)]).astype(np.int32)
    _, prefix_final, _ = xla.kda(**prefix_inputs, initial_state=np.repeat(init, 4, axis=0), cu_seqlens=prefix_cu,
                                     use_qk_l2norm=True, state_layout="vk")
    for m in range(4):
        assert rel_rms(checkpoints[m], prefix_final[m]) <= FP32_TOL, m


def test_traced_metadata_compiles_once():
    rng = np.random.default_rng(606)
    inputs = make_inputs(rng, 96, 16, 16, per_channel=False)
    traces = []

    @jax.jit
    def run(inputs, cu_seqlens, checkpoint_cu, checkpoint_offsets):
        traces.append(None)
        return xla.gated_delta_rule(**inputs, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                                        checkpoint_offsets=checkpoint_offsets, use_qk_l2norm=True, chunk_size=16)

    batches = [(np.array([0, 40, 41, 90], np.int32), np.array([0, 2, 2, 3], np.int32), np.array([1, 39, 17, 0])),
               (np.array([0, 0, 70, 96], np.int32), np.array([0, 0, 3, 4], np.int32), np.array([16, 32, 69, 5]))]
    for cu, ccu, offsets in batches:
        offsets = offsets.astype(np.int32)
        out = run(inputs, cu, ccu, offsets)
        expected = reference.gated_delta_rule(**inputs, cu_seqlens=cu, checkpoint_cu=ccu,
                                                  checkpoint_offsets=offsets, use_qk_l2norm=True)
        assert_matches(out, expected, FP32_TOL)
    assert len(traces) == 1


@pytest.mark.parametrize("per_channel, method", [(False, "forced_break"), (True, "in_chunk")])
def test_bfloat16_inputs_land_in_the_bf16_class(per_channel, method):
    rng = np.random.default_rng(707 + per_channel)
    inputs = make_inputs(rng, NUM_TOKENS, 16, 16, per_channel=per_channel, dtype=ml_dtypes.bfloat16)
    inputs["g"], inputs["beta"] = inputs["g"].astype(np.float32), inputs["beta"].astype(np.float32)
    init = make_initial_state(rng, 5, 16, 16, "kv", rows_with_state=(2, 4))
    kwargs = varlen_kwargs(init, use_qk_l2norm=True)
    op, ref = (xla.kda, reference.kda) if per_channel else (xla.gated_delta_rule,
                                                                      reference.gated_delta_rule)
    out = op(**{name: jnp.asarray(x) for name, x in inputs.items()}, **kwargs, chunk_size=16,
             checkpoint_method=method)
    assert out[0].dtype == jnp.bfloat16 and out[1].dtype == out[2].dtype == jnp.float32
    # bf16 operands with fp32 accumulation against the float64 recurrence on the same bf16 values
    assert_matches(out, ref(**inputs, **kwargs), BF16_TOL)


@pytest.mark.parametrize("per_channel, method", [(False, "in_chunk"), (False, "forced_break"),
                                                 (True, "in_chunk"), (True, "forced_break")])
def test_associative_and_sequential_state_passes_agree(per_channel, method):
    rng = np.random.default_rng(303 + 2 * per_channel + (method == "in_chunk"))
    inputs = make_inputs(rng, NUM_TOKENS, 16, 16, per_channel=per_channel)
    init = make_initial_state(rng, 5, 16, 16, "vk", rows_with_state=(0, 2, 4))
    op = xla.kda if per_channel else xla.gated_delta_rule
    options = dict(use_qk_l2norm=True, state_layout="vk", chunk_size=16, checkpoint_method=method)
    associative = op(**inputs, **varlen_kwargs(init, **options))
    sequential = op(**inputs, **varlen_kwargs(init, **options), state_pass="sequential")
    assert_matches(sequential, associative, 1e-6)
    if method == "in_chunk":
        without = op(**inputs, initial_state=init, cu_seqlens=CU_SEQLENS, **options, state_pass="sequential")
        np.testing.assert_array_equal(sequential[0], without[0])
        np.testing.assert_array_equal(sequential[1], without[1])


def token_scan(q, k, v, g, beta, initial_state, *, checkpoint_at):
    """One row token by token with lax.scan, in the inputs' dtype: (o, final state, state after checkpoint_at)."""
    def norm(x):
        return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    group = v.shape[1] // q.shape[1]
    q = jnp.repeat(norm(q), group, axis=1) * q.shape[-1] ** -0.5
    k = jnp.repeat(norm(k), group, axis=1)
    decay = jnp.exp(g if g.ndim == 3 else g[:, :, None])

    def step(state, x):
        q_t, k_t, v_t, decay_t, beta_t = x
        state = decay_t[:, :, None] * state
        u = beta_t[:, None] * (v_t - jnp.einsum("hkv,hk->hv", state, k_t))
        state = state + k_t[:, :, None] * u[:, None, :]
        return state, (jnp.einsum("hkv,hk->hv", state, q_t), state)

    final, (o, states) = jax.lax.scan(step, initial_state, (q, k, v, decay, beta))
    return o, final, states[checkpoint_at - 1]


@pytest.mark.parametrize("per_channel", [False, True])
def test_gradients_match_token_scan(per_channel):
    rng = np.random.default_rng(808 + per_channel)
    length, checkpoint_at = 40, 23
    inputs = make_inputs(rng, length, 16, 16, per_channel=per_channel)
    init = rng.normal(size=(1, HV, 16, 16)).astype(np.float32)
    weights = [rng.normal(size=shape) for shape in ((length, HV, 16), (HV, 16, 16), (HV, 16, 16))]
    op = xla.kda if per_channel else xla.gated_delta_rule
    names = ("q", "k", "v", "g", "beta")

    def chunked_loss(args):
        *xs, state = args
        outs = op(*xs, initial_state=state, checkpoint_cu=jnp.array([0, 1], jnp.int32),
                  checkpoint_offsets=jnp.array([checkpoint_at], jnp.int32), use_qk_l2norm=True, chunk_size=16)
        return sum(jnp.sum(out.reshape(w.shape) * w) for out, w in zip(outs, weights))

    def scan_loss(args):
        *xs, state = args
        outs = token_scan(*xs, state[0], checkpoint_at=checkpoint_at)
        return sum(jnp.sum(out * w) for out, w in zip(outs, weights))

    args32 = [jnp.asarray(inputs[name]) for name in names] + [jnp.asarray(init)]
    grads = jax.grad(chunked_loss)(args32)
    with jax.enable_x64(True):
        expected = jax.grad(scan_loss)([jnp.asarray(x, jnp.float64) for x in args32])
        expected = [np.asarray(e) for e in expected]
    for name, got, want in zip((*names, "initial_state"), grads, expected):
        assert rel_rms(got, want) <= FP32_TOL, (name, rel_rms(got, want))


def test_static_validation():
    rng = np.random.default_rng(909)
    inputs = {name: jnp.asarray(x) for name, x in make_inputs(rng, 8, 16, 16, per_channel=False).items()}
    bad = [
        (dict(q=inputs["q"][0]), "q: "),
        (dict(v=inputs["v"][:, :3]), "v: "),
        (dict(g=inputs["g"][..., None]), "g: "),
        (dict(beta=inputs["beta"][:4]), "beta: "),
        (dict(initial_state=jnp.zeros((2, HV, 16, 16))), "initial_state: "),
        (dict(cu_seqlens=jnp.array([0.0, 8.0])), "cu_seqlens: "),
        (dict(checkpoint_cu=jnp.array([0, 0], jnp.int32)), "checkpoint_cu and checkpoint_offsets: "),
        (dict(checkpoint_cu=jnp.array([0, 0, 0], jnp.int32), checkpoint_offsets=jnp.zeros(1, jnp.int32)),
         "checkpoint_cu: "),
        (dict(state_layout="kvv"), "state_layout: "),
        (dict(chunk_size=0), "chunk_size: "),
        (dict(checkpoint_method="split"), "checkpoint_method: "),
        (dict(state_pass="parallel"), "state_pass: "),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=f"^{message}"):
            xla.gated_delta_rule(**{**inputs, **change})
    kda_inputs = {**inputs, "g": jnp.zeros((8, HV, 16))}
    for change, message in [(dict(lower_bound=-6.0), "lower_bound: "), (dict(lower_bound=0.0), "lower_bound: "),
                            (dict(A_log=jnp.zeros(3)), "A_log: "), (dict(dt_bias=jnp.zeros(HV * 16)), "dt_bias: "),
                            (dict(A_log=jnp.zeros(HV), dt_bias=jnp.zeros((HV, 8))), "dt_bias: ")]:
        with pytest.raises(ValueError, match=f"^{message}"):
            xla.kda(**kda_inputs, **change)


def test_empty_batch():
    rng = np.random.default_rng(1010)
    inputs = make_inputs(rng, 0, 16, 16, per_channel=True)
    init = rng.normal(size=(2, HV, 16, 16)).astype(np.float32)
    o, final, checkpoints = xla.kda(**inputs, initial_state=init, cu_seqlens=np.array([0, 0, 0], np.int32),
                                        checkpoint_cu=np.zeros(3, np.int32), checkpoint_offsets=np.zeros(1, np.int32))
    assert o.shape == (0, HV, 16) and checkpoints.shape == (1, HV, 16, 16)
    np.testing.assert_array_equal(final, init)
    assert np.all(np.asarray(checkpoints) == 0)
