"""Properties of the float64 GDN reference, checked against independent formulations (chunked WY/UT form with the
in-chunk checkpoint formula of jaxckpt/ops/delta_rule/README.md, the transition-product form, closed forms)."""

import ml_dtypes
import numpy as np
import pytest

from jaxckpt.ops.delta_rule.reference import gated_delta_rule
from jaxckpt.plan.conventions import PAD_CHECKPOINT_OFFSET

H, HV, K, V = 2, 4, 8, 8
TOL = dict(rtol=1e-10, atol=1e-12)


def _l2norm(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _inputs(rng, num_tokens, *, num_heads=H, num_v_heads=HV, head_k=K, head_v=V):
    q = rng.standard_normal((num_tokens, num_heads, head_k))
    k = rng.standard_normal((num_tokens, num_heads, head_k))
    v = rng.standard_normal((num_tokens, num_v_heads, head_v))
    g = -rng.uniform(0.01, 0.6, (num_tokens, num_v_heads))
    beta = rng.uniform(0.0, 1.0, (num_tokens, num_v_heads))
    return q, k, v, g, beta


def _states(rng, num_rows, *, head_k=K, head_v=V):
    return rng.standard_normal((num_rows, HV, head_k, head_v))


def _chunked_wy_head(q, k, v, g, beta, s, offsets, *, chunk):
    """One row, one value head, chunked WY/UT form; q already scaled. Returns (o [L, V], final [K, V], {p: state})."""
    o = np.zeros_like(v)
    states = {}
    for c0 in range(0, len(g), chunk):
        qc, kc, vc, bc = q[c0:c0 + chunk], k[c0:c0 + chunk], v[c0:c0 + chunk], beta[c0:c0 + chunk]
        G = np.cumsum(g[c0:c0 + chunk])
        n = G.size
        causal = np.tril(np.ones((n, n), bool))
        decay = np.exp(np.where(causal, G[:, None] - G[None, :], -np.inf))  # exp(G_i - G_j), j <= i
        A = np.tril(bc[:, None] * (kc @ kc.T) * decay, -1)
        W = np.linalg.solve(np.eye(n) + A, (bc * np.exp(G))[:, None] * kc)
        U = np.linalg.solve(np.eye(n) + A, bc[:, None] * vc)
        v_new = U - W @ s
        o[c0:c0 + n] = (qc * np.exp(G)[:, None]) @ s + (np.tril(qc @ kc.T) * decay) @ v_new
        for r in range(1, n + 1):
            if c0 + r in offsets:
                states[c0 + r] = np.exp(G[r - 1]) * s + (kc[:r] * np.exp(G[r - 1] - G[:r])[:, None]).T @ v_new[:r]
        s = np.exp(G[-1]) * s + (kc * np.exp(G[-1] - G)[:, None]).T @ v_new
    return o, s, states


def test_matches_chunked_wy_form_with_in_chunk_checkpoints():
    rng = np.random.default_rng(101)
    q, k, v, g, beta = _inputs(rng, 23)
    s0 = _states(rng, 1)
    offsets = [1, 4, 5, 11, 22]
    scale = 0.7
    o, final, ckpt = gated_delta_rule(q, k, v, g, beta, scale=scale, use_qk_l2norm=True, initial_state=s0,
                                      checkpoint_cu=[0, len(offsets)], checkpoint_offsets=offsets)
    qn, kn = _l2norm(q) * scale, _l2norm(k)
    for h in range(HV):
        hk = h // (HV // H)
        o_h, final_h, states_h = _chunked_wy_head(qn[:, hk], kn[:, hk], v[:, h], g[:, h], beta[:, h], s0[0, h],
                                                  offsets, chunk=4)
        np.testing.assert_allclose(o[:, h], o_h, **TOL)
        np.testing.assert_allclose(final[0, h], final_h, **TOL)
        for m, p in enumerate(offsets):
            np.testing.assert_allclose(ckpt[m, h], states_h[p], **TOL)


def test_final_state_matches_transition_product_form():
    rng = np.random.default_rng(102)
    q, k, v, g, beta = _inputs(rng, 19)
    k = _l2norm(k)
    s0 = _states(rng, 1)
    _, final, _ = gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    _, final_from_zero, _ = gated_delta_rule(q, k, v, g, beta)
    for h in range(HV):
        kh = k[:, h // (HV // H)]
        transition, affine = np.eye(K), np.zeros((K, V))
        for t in range(len(g)):
            step = np.exp(g[t, h]) * (np.eye(K) - beta[t, h] * np.outer(kh[t], kh[t]))
            transition = step @ transition
            affine = step @ affine + beta[t, h] * np.outer(kh[t], v[t, h])
        np.testing.assert_allclose(final[0, h], transition @ s0[0, h] + affine, **TOL)
        np.testing.assert_allclose(final_from_zero[0, h], affine, **TOL)


def test_zero_beta_only_decays_the_initial_state():
    rng = np.random.default_rng(103)
    q, k, v, g, _ = _inputs(rng, 11)
    s0 = _states(rng, 1)
    o, final, _ = gated_delta_rule(q, k, v, g, np.zeros_like(g), initial_state=s0)
    G = np.cumsum(g, axis=0)  # [T, HV]
    q_heads = np.repeat(q, HV // H, axis=1) * K ** -0.5
    expected = np.exp(G)[:, :, None] * np.einsum("hkv,thk->thv", s0[0], q_heads)
    np.testing.assert_allclose(o, expected, **TOL)
    np.testing.assert_allclose(final[0], np.exp(G[-1])[:, None, None] * s0[0], **TOL)


def test_single_token_closed_form():
    rng = np.random.default_rng(104)
    q, k, v, g, beta = _inputs(rng, 1)
    s0 = _states(rng, 1)
    o, final, _ = gated_delta_rule(q, k, v, g, beta, scale=1.3, initial_state=s0)
    for h in range(HV):
        kh, qh = k[0, h // (HV // H)], q[0, h // (HV // H)]
        a, b = np.exp(g[0, h]), beta[0, h]
        s1 = a * (np.eye(K) - b * np.outer(kh, kh)) @ s0[0, h] + b * np.outer(kh, v[0, h])
        np.testing.assert_allclose(final[0, h], s1, **TOL)
        np.testing.assert_allclose(o[0, h], s1.T @ (1.3 * qh), **TOL)


def test_checkpoint_is_prefix_final_state_and_resumes_the_rest():
    rng = np.random.default_rng(105)
    q, k, v, g, beta = _inputs(rng, 37)
    s0 = _states(rng, 1)
    offsets = [1, 5, 16, 36]
    o, final, ckpt = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, initial_state=s0,
                                      checkpoint_cu=[0, 4], checkpoint_offsets=offsets)
    for m, p in enumerate(offsets):
        _, prefix_final, _ = gated_delta_rule(q[:p], k[:p], v[:p], g[:p], beta[:p], use_qk_l2norm=True,
                                              initial_state=s0)
        np.testing.assert_allclose(ckpt[m], prefix_final[0], **TOL)
        rest_o, rest_final, _ = gated_delta_rule(q[p:], k[p:], v[p:], g[p:], beta[p:], use_qk_l2norm=True,
                                                 initial_state=ckpt[m:m + 1])
        np.testing.assert_allclose(rest_o, o[p:], **TOL)
        np.testing.assert_allclose(rest_final, final, **TOL)


LENGTHS = [6, 0, 1, 17, 9]
ROW_OFFSETS = [[2, 5], [], [], [4, 8, 16], [1]]


def _batch(rng, *, padding=3):
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    q, k, v, g, beta = _inputs(rng, int(cu[-1]) + padding)
    checkpoint_cu = np.concatenate([[0], np.cumsum([len(r) for r in ROW_OFFSETS])]).astype(np.int32)
    checkpoint_offsets = np.array([p for r in ROW_OFFSETS for p in r], np.int32)
    return (q, k, v, g, beta), cu, checkpoint_cu, checkpoint_offsets


@pytest.mark.parametrize("with_initial_state", [False, True])
def test_batch_row_equals_row_alone(with_initial_state):
    rng = np.random.default_rng(106 + with_initial_state)
    inputs, cu, checkpoint_cu, checkpoint_offsets = _batch(rng)
    s0 = _states(rng, len(LENGTHS)) if with_initial_state else None
    o, final, ckpt = gated_delta_rule(*inputs, use_qk_l2norm=True, initial_state=s0, cu_seqlens=cu,
                                      checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets)
    assert not o[cu[-1]:].any()
    for n, offsets in enumerate(ROW_OFFSETS):
        row = [x[cu[n]:cu[n + 1]] for x in inputs]
        row_o, row_final, row_ckpt = gated_delta_rule(
            *row, use_qk_l2norm=True, initial_state=None if s0 is None else s0[n:n + 1],
            checkpoint_cu=[0, len(offsets)], checkpoint_offsets=offsets)
        np.testing.assert_allclose(o[cu[n]:cu[n + 1]], row_o, **TOL)
        np.testing.assert_allclose(final[n], row_final[0], **TOL)
        np.testing.assert_allclose(ckpt[checkpoint_cu[n]:checkpoint_cu[n + 1]], row_ckpt, **TOL)
    np.testing.assert_array_equal(final[1], 0.0 if s0 is None else s0[1])


def test_padded_checkpoint_entries_are_zero_and_change_nothing():
    rng = np.random.default_rng(108)
    inputs, cu, checkpoint_cu, checkpoint_offsets = _batch(rng)
    s0 = _states(rng, len(LENGTHS))
    padded = np.concatenate([checkpoint_offsets, np.full(3, PAD_CHECKPOINT_OFFSET, np.int32)])
    o, final, ckpt = gated_delta_rule(*inputs, initial_state=s0, cu_seqlens=cu, checkpoint_cu=checkpoint_cu,
                                      checkpoint_offsets=checkpoint_offsets)
    o_p, final_p, ckpt_p = gated_delta_rule(*inputs, initial_state=s0, cu_seqlens=cu, checkpoint_cu=checkpoint_cu,
                                            checkpoint_offsets=padded)
    assert ckpt_p.shape == (padded.size, HV, K, V)
    np.testing.assert_array_equal(ckpt_p[:checkpoint_offsets.size], ckpt)
    np.testing.assert_array_equal(ckpt_p[checkpoint_offsets.size:], 0.0)
    np.testing.assert_array_equal(o_p, o)
    np.testing.assert_array_equal(final_p, final)


def test_vk_layout_is_the_transpose():
    rng = np.random.default_rng(109)
    inputs, cu, checkpoint_cu, checkpoint_offsets = _batch(rng)
    s0 = _states(rng, len(LENGTHS), head_k=K, head_v=V)
    o, final, ckpt = gated_delta_rule(*inputs, initial_state=s0, cu_seqlens=cu, checkpoint_cu=checkpoint_cu,
                                      checkpoint_offsets=checkpoint_offsets)
    o_vk, final_vk, ckpt_vk = gated_delta_rule(*inputs, initial_state=s0.swapaxes(-1, -2), cu_seqlens=cu,
                                               checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                                               state_layout="vk")
    np.testing.assert_array_equal(o_vk, o)
    np.testing.assert_array_equal(final_vk, final.swapaxes(-1, -2))
    np.testing.assert_array_equal(ckpt_vk, ckpt.swapaxes(-1, -2))


def test_vk_layout_with_k_not_equal_v():
    rng = np.random.default_rng(110)
    q, k, v, g, beta = _inputs(rng, 9, head_k=8, head_v=5)
    s0 = _states(rng, 1, head_k=8, head_v=5)
    o, final, ckpt = gated_delta_rule(q, k, v, g, beta, initial_state=s0, checkpoint_cu=[0, 1],
                                      checkpoint_offsets=[4])
    o_vk, final_vk, ckpt_vk = gated_delta_rule(q, k, v, g, beta, initial_state=s0.swapaxes(-1, -2),
                                               checkpoint_cu=[0, 1], checkpoint_offsets=[4], state_layout="vk")
    assert final_vk.shape == (1, HV, 5, 8) and ckpt_vk.shape == (1, HV, 5, 8)
    np.testing.assert_array_equal(o_vk, o)
    np.testing.assert_array_equal(final_vk, final.swapaxes(-1, -2))
    np.testing.assert_array_equal(ckpt_vk, ckpt.swapaxes(-1, -2))


def test_grouped_value_heads_read_their_key_head():
    rng = np.random.default_rng(111)
    q, k, v, g, beta = _inputs(rng, 13)
    o, final, _ = gated_delta_rule(q, k, v, g, beta, scale=0.4)
    o_rep, final_rep, _ = gated_delta_rule(np.repeat(q, HV // H, axis=1), np.repeat(k, HV // H, axis=1), v, g, beta,
                                           scale=0.4)
    np.testing.assert_array_equal(o, o_rep)
    np.testing.assert_array_equal(final, final_rep)


def test_default_scale_and_l2norm():
    rng = np.random.default_rng(112)
    q, k, v, g, beta = _inputs(rng, 10)
    o, final, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    o_manual, final_manual, _ = gated_delta_rule(_l2norm(q), _l2norm(k), v, g, beta, scale=K ** -0.5)
    np.testing.assert_allclose(o, o_manual, **TOL)
    np.testing.assert_allclose(final, final_manual, **TOL)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_inputs_are_computed_in_float64(dtype):
    rng = np.random.default_rng(113)
    inputs = [x.astype(dtype) for x in _inputs(rng, 12)]
    s0 = _states(rng, 1).astype(dtype)
    outs = gated_delta_rule(*inputs, initial_state=s0, checkpoint_cu=[0, 1], checkpoint_offsets=[7])
    outs64 = gated_delta_rule(*[x.astype(np.float64) for x in inputs], initial_state=s0.astype(np.float64),
                              checkpoint_cu=[0, 1], checkpoint_offsets=[7])
    for out, out64 in zip(outs, outs64):
        assert out.dtype == np.float64
        np.testing.assert_array_equal(out, out64)


def _bad_cases():
    rng = np.random.default_rng(114)
    q, k, v, g, beta = _inputs(rng, 10, head_k=8, head_v=6)
    base = dict(q=q, k=k, v=v, g=g, beta=beta)
    return [
        ("q", dict(base, q=q[:, 0])),
        ("q", dict(base, q=np.ones(q.shape, np.int32))),
        ("k", dict(base, k=k[:, :, :4])),
        ("v", dict(base, v=v[:9])),
        ("v", dict(base, v=v[:, :3])),
        ("v", dict(base, v=v.astype(np.complex128))),
        ("g", dict(base, g=g[:, :, None])),
        ("g", dict(base, g=g[:, :2])),
        ("beta", dict(base, beta=beta[:9])),
        ("beta", dict(base, beta=beta > 0.5)),
        ("initial_state", dict(base, initial_state=np.zeros((1, HV, 8, 6)), state_layout="vk")),
        ("initial_state", dict(base, initial_state=np.zeros((2, HV, 8, 6)))),
        ("initial_state", dict(base, initial_state=np.zeros((1, HV, 8, 6), np.int64))),
        ("state_layout", dict(base, state_layout="kv_t")),
        ("scale", dict(base, scale=float("nan"))),
        ("cu_seqlens", dict(base, cu_seqlens=[0, 4, 11])),
        ("cu_seqlens", dict(base, cu_seqlens=[0, 5, 3])),
        ("cu_seqlens", dict(base, cu_seqlens=[1, 5])),
        ("checkpoint_cu", dict(base, checkpoint_cu=[0, 1])),
        ("checkpoint_cu", dict(base, cu_seqlens=[0, 4, 10], checkpoint_cu=[0, 1], checkpoint_offsets=[2])),
        ("checkpoint_offsets", dict(base, checkpoint_cu=[0, 1], checkpoint_offsets=[10])),
        ("checkpoint_offsets", dict(base, checkpoint_cu=[0, 2], checkpoint_offsets=[5, 3])),
        ("checkpoint_offsets", dict(base, checkpoint_cu=[0, 1], checkpoint_offsets=[3, 4])),
    ]


@pytest.mark.parametrize("name,kwargs", _bad_cases())
def test_bad_input_names_the_argument(name, kwargs):
    args = [kwargs.pop(x) for x in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        gated_delta_rule(*args, **kwargs)
