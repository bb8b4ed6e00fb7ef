"""Properties of the float64 KDA reference and its gate, checked against independent formulations (chunked WY/UT form
with per-channel decays and the in-chunk checkpoint formula of jaxckpt/ops/delta_rule/README.md, the transition-product
form, closed forms, GDN for channel-constant decays, direct gate formulas)."""

import math

import ml_dtypes
import numpy as np
import pytest

from jaxckpt.ops.delta_rule.reference import gated_delta_rule, kda, kda_gate
from jaxckpt.plan.conventions import PAD_CHECKPOINT_OFFSET

H, HV, K, V = 2, 4, 8, 8
TOL = dict(rtol=1e-10, atol=1e-12)


def _l2norm(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _inputs(rng, num_tokens, *, num_heads=H, num_v_heads=HV, head_k=K, head_v=V):
    q = rng.standard_normal((num_tokens, num_heads, head_k))
    k = rng.standard_normal((num_tokens, num_heads, head_k))
    v = rng.standard_normal((num_tokens, num_v_heads, head_v))
    g = -rng.uniform(0.01, 0.8, (num_tokens, num_v_heads, head_k))
    beta = rng.uniform(0.0, 1.0, (num_tokens, num_v_heads))
    return q, k, v, g, beta


def _states(rng, num_rows, *, head_k=K, head_v=V):
    return rng.standard_normal((num_rows, HV, head_k, head_v))


def _chunked_wy_head(q, k, v, g, beta, s, offsets, *, chunk):
    """One row, one value head, chunked WY/UT form with per-channel decays; q already scaled.

    Returns (o [L, V], final [K, V], {p: state after p tokens}).
    """
    o = np.zeros_like(v)
    states = {}
    for c0 in range(0, len(g), chunk):
        qc, kc, vc, bc = q[c0:c0 + chunk], k[c0:c0 + chunk], v[c0:c0 + chunk], beta[c0:c0 + chunk]
        G = np.cumsum(g[c0:c0 + chunk], axis=0)  # [n, K]
        n = G.shape[0]
        causal = np.tril(np.ones((n, n), bool))[:, :, None]
        decay = np.exp(np.where(causal, G[:, None, :] - G[None, :, :], -np.inf))  # [n, n, K], j <= i
        A = np.tril(bc[:, None] * np.einsum("ic,jc,ijc->ij", kc, kc, decay), -1)
        Aqk = np.einsum("ic,jc,ijc->ij", qc, kc, decay)
        W = np.linalg.solve(np.eye(n) + A, bc[:, None] * np.exp(G) * kc)
        U = np.linalg.solve(np.eye(n) + A, bc[:, None] * vc)
        v_new = U - W @ s
        o[c0:c0 + n] = (qc * np.exp(G)) @ s + Aqk @ v_new
        for r in range(1, n + 1):
            if c0 + r in offsets:
                states[c0 + r] = np.exp(G[r - 1])[:, None] * s + (kc[:r] * np.exp(G[r - 1] - G[:r])).T @ v_new[:r]
        s = np.exp(G[-1])[:, None] * s + (kc * np.exp(G[-1] - G)).T @ v_new
    return o, s, states


def test_matches_chunked_wy_form_with_in_chunk_checkpoints():
    rng = np.random.default_rng(201)
    q, k, v, g, beta = _inputs(rng, 23)
    s0 = _states(rng, 1)
    offsets = [2, 4, 7, 13, 22]
    scale = 0.6
    o, final, ckpt = kda(q, k, v, g, beta, scale=scale, use_qk_l2norm=True, initial_state=s0,
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
    rng = np.random.default_rng(202)
    q, k, v, g, beta = _inputs(rng, 19)
    k = _l2norm(k)
    s0 = _states(rng, 1)
    _, final, _ = kda(q, k, v, g, beta, initial_state=s0)
    _, final_from_zero, _ = kda(q, k, v, g, beta)
    for h in range(HV):
        kh = k[:, h // (HV // H)]
        transition, affine = np.eye(K), np.zeros((K, V))
        for t in range(len(g)):
            step = (np.eye(K) - beta[t, h] * np.outer(kh[t], kh[t])) @ np.diag(np.exp(g[t, h]))
            transition = step @ transition
            affine = step @ affine + beta[t, h] * np.outer(kh[t], v[t, h])
        np.testing.assert_allclose(final[0, h], transition @ s0[0, h] + affine, **TOL)
        np.testing.assert_allclose(final_from_zero[0, h], affine, **TOL)


def test_zero_beta_only_decays_the_initial_state():
    rng = np.random.default_rng(203)
    q, k, v, g, beta = _inputs(rng, 11)
    s0 = _states(rng, 1)
    o, final, _ = kda(q, k, v, g, np.zeros_like(beta), initial_state=s0)
    G = np.cumsum(g, axis=0)  # [T, HV, K]
    q_heads = np.repeat(q, HV // H, axis=1) * K ** -0.5
    expected = np.einsum("hkv,thk->thv", s0[0], q_heads * np.exp(G))
    np.testing.assert_allclose(o, expected, **TOL)
    np.testing.assert_allclose(final[0], np.exp(G[-1])[:, :, None] * s0[0], **TOL)


def test_single_token_closed_form():
    rng = np.random.default_rng(204)
    q, k, v, g, beta = _inputs(rng, 1)
    s0 = _states(rng, 1)
    o, final, _ = kda(q, k, v, g, beta, scale=1.3, initial_state=s0)
    for h in range(HV):
        kh, qh = k[0, h // (HV // H)], q[0, h // (HV // H)]
        b = beta[0, h]
        decayed = np.exp(g[0, h])[:, None] * s0[0, h]
        s1 = (np.eye(K) - b * np.outer(kh, kh)) @ decayed + b * np.outer(kh, v[0, h])
        np.testing.assert_allclose(final[0, h], s1, **TOL)
        np.testing.assert_allclose(o[0, h], s1.T @ (1.3 * qh), **TOL)


def test_channel_constant_decay_equals_gdn():
    rng = np.random.default_rng(205)
    q, k, v, g, beta = _inputs(rng, 21)
    g_head = g[:, :, 0]
    s0 = _states(rng, 1)
    options = dict(use_qk_l2norm=True, initial_state=s0, checkpoint_cu=[0, 2], checkpoint_offsets=[3, 10])
    outs = kda(q, k, v, np.repeat(g_head[:, :, None], K, axis=2), beta, **options)
    outs_gdn = gated_delta_rule(q, k, v, g_head, beta, **options)
    for out, out_gdn in zip(outs, outs_gdn):
        np.testing.assert_allclose(out, out_gdn, **TOL)


def test_checkpoint_is_prefix_final_state_and_resumes_the_rest():
    rng = np.random.default_rng(206)
    q, k, v, g, beta = _inputs(rng, 31)
    s0 = _states(rng, 1)
    offsets = [1, 8, 9, 30]
    o, final, ckpt = kda(q, k, v, g, beta, use_qk_l2norm=True, initial_state=s0, checkpoint_cu=[0, 4],
                         checkpoint_offsets=offsets)
    for m, p in enumerate(offsets):
        _, prefix_final, _ = kda(q[:p], k[:p], v[:p], g[:p], beta[:p], use_qk_l2norm=True, initial_state=s0)
        np.testing.assert_allclose(ckpt[m], prefix_final[0], **TOL)
        rest_o, rest_final, _ = kda(q[p:], k[p:], v[p:], g[p:], beta[p:], use_qk_l2norm=True,
                                    initial_state=ckpt[m:m + 1])
        np.testing.assert_allclose(rest_o, o[p:], **TOL)
        np.testing.assert_allclose(rest_final, final, **TOL)


LENGTHS = [0, 7, 1, 15, 4]
ROW_OFFSETS = [[], [3, 6], [], [1, 2, 12], [2]]


def _batch(rng, *, padding=2):
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    q, k, v, g, beta = _inputs(rng, int(cu[-1]) + padding)
    checkpoint_cu = np.concatenate([[0], np.cumsum([len(r) for r in ROW_OFFSETS])]).astype(np.int32)
    checkpoint_offsets = np.array([p for r in ROW_OFFSETS for p in r], np.int32)
    return (q, k, v, g, beta), cu, checkpoint_cu, checkpoint_offsets


@pytest.mark.parametrize("with_initial_state", [False, True])
def test_batch_row_equals_row_alone(with_initial_state):
    rng = np.random.default_rng(207 + with_initial_state)
    inputs, cu, checkpoint_cu, checkpoint_offsets = _batch(rng)
    s0 = _states(rng, len(LENGTHS)) if with_initial_state else None
    gate = dict(A_log=rng.uniform(-1.0, 1.0, HV), dt_bias=rng.standard_normal(HV * K))
    o, final, ckpt = kda(*inputs, use_qk_l2norm=True, initial_state=s0, cu_seqlens=cu, checkpoint_cu=checkpoint_cu,
                         checkpoint_offsets=checkpoint_offsets, **gate)
    assert not o[cu[-1]:].any()
    for n, offsets in enumerate(ROW_OFFSETS):
        row = [x[cu[n]:cu[n + 1]] for x in inputs]
        row_o, row_final, row_ckpt = kda(*row, use_qk_l2norm=True, initial_state=None if s0 is None else s0[n:n + 1],
                                         checkpoint_cu=[0, len(offsets)], checkpoint_offsets=offsets, **gate)
        np.testing.assert_allclose(o[cu[n]:cu[n + 1]], row_o, **TOL)
        np.testing.assert_allclose(final[n], row_final[0], **TOL)
        np.testing.assert_allclose(ckpt[checkpoint_cu[n]:checkpoint_cu[n + 1]], row_ckpt, **TOL)
    np.testing.assert_array_equal(final[0], 0.0 if s0 is None else s0[0])


def test_padded_checkpoint_entries_are_zero_and_change_nothing():
    rng = np.random.default_rng(209)
    inputs, cu, checkpoint_cu, checkpoint_offsets = _batch(rng)
    s0 = _states(rng, len(LENGTHS))
    padded = np.concatenate([checkpoint_offsets, np.full(4, PAD_CHECKPOINT_OFFSET, np.int32)])
    o, final, ckpt = kda(*inputs, initial_state=s0, cu_seqlens=cu, checkpoint_cu=checkpoint_cu,
                         checkpoint_offsets=checkpoint_offsets)
    o_p, final_p, ckpt_p = kda(*inputs, initial_state=s0, cu_seqlens=cu, checkpoint_cu=checkpoint_cu,
                               checkpoint_offsets=padded)
    assert ckpt_p.shape == (padded.size, HV, K, V)
    np.testing.assert_array_equal(ckpt_p[:checkpoint_offsets.size], ckpt)
    np.testing.assert_array_equal(ckpt_p[checkpoint_offsets.size:], 0.0)
    np.testing.assert_array_equal(o_p, o)
    np.testing.assert_array_equal(final_p, final)


def test_vk_layout_is_the_transpose():
    rng = np.random.default_rng(210)
    q, k, v, g, beta = _inputs(rng, 14, head_k=8, head_v=5)
    s0 = _states(rng, 2, head_k=8, head_v=5)
    options = dict(cu_seqlens=[0, 6, 14], checkpoint_cu=[0, 1, 3], checkpoint_offsets=[3, 2, 7])
    o, final, ckpt = kda(q, k, v, g, beta, initial_state=s0, **options)
    o_vk, final_vk, ckpt_vk = kda(q, k, v, g, beta, initial_state=s0.swapaxes(-1, -2), state_layout="vk", **options)
    assert final_vk.shape == (2, HV, 5, 8) and ckpt_vk.shape == (3, HV, 5, 8)
    np.testing.assert_array_equal(o_vk, o)
    np.testing.assert_array_equal(final_vk, final.swapaxes(-1, -2))
    np.testing.assert_array_equal(ckpt_vk, ckpt.swapaxes(-1, -2))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_inputs_are_computed_in_float64(dtype):
    rng = np.random.default_rng(211)
    inputs = [x.astype(dtype) for x in _inputs(rng, 12)]
    s0 = _states(rng, 1).astype(dtype)
    a_log, dt_bias = rng.standard_normal(HV).astype(dtype), rng.standard_normal((HV, K)).astype(dtype)
    outs = kda(*inputs, initial_state=s0, checkpoint_cu=[0, 1], checkpoint_offsets=[7], A_log=a_log,
               dt_bias=dt_bias)
    outs64 = kda(*[x.astype(np.float64) for x in inputs], initial_state=s0.astype(np.float64), checkpoint_cu=[0, 1],
                 checkpoint_offsets=[7], A_log=a_log.astype(np.float64), dt_bias=dt_bias.astype(np.float64))
    for out, out64 in zip(outs, outs64):
        assert out.dtype == np.float64
        np.testing.assert_array_equal(out, out64)


def test_gate_formulas_match_direct_evaluation():
    rng = np.random.default_rng(212)
    raw = rng.uniform(-6.0, 6.0, (5, HV, K))
    a_log = rng.uniform(-1.0, 2.0, HV)
    dt_bias = rng.standard_normal((HV, K))
    x = raw + dt_bias
    rate = np.exp(a_log)[None, :, None]
    softplus = np.log1p(np.exp(x))
    np.testing.assert_allclose(kda_gate(raw), raw, rtol=0, atol=0)
    np.testing.assert_allclose(kda_gate(raw, A_log=a_log, dt_bias=dt_bias), -rate * softplus, rtol=1e-13)
    np.testing.assert_allclose(kda_gate(raw, A_log=a_log, dt_bias=dt_bias.reshape(-1)), -rate * softplus,
                               rtol=1e-13)
    np.testing.assert_allclose(kda_gate(raw, A_log=a_log), -rate * np.log1p(np.exp(raw)), rtol=1e-13)
    np.testing.assert_allclose(kda_gate(raw, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0),
                               -5.0 / (1.0 + np.exp(-rate * x)), rtol=1e-13)
    np.testing.assert_allclose(kda_gate(raw, dt_bias=dt_bias, lower_bound=-2.5), -2.5 / (1.0 + np.exp(-x)),
                               rtol=1e-13)
    bounded = kda_gate(raw, dt_bias=dt_bias, lower_bound=-1.0)
    assert np.all((bounded >= -1.0) & (bounded < 0.0))


def test_gate_known_values():
    g = np.zeros((1, 1, 2))
    np.testing.assert_allclose(kda_gate(g, A_log=np.zeros(1)), -math.log(2.0), rtol=1e-15)
    np.testing.assert_allclose(kda_gate(g, lower_bound=-5.0), -2.5, rtol=1e-15)
    # softplus(log(e - 1)) = 1, so the decay is -exp(A_log) = -3
    np.testing.assert_allclose(kda_gate(g + math.log(math.e - 1.0), A_log=np.log([3.0])), -3.0, rtol=1e-14)
    # sigmoid(2 * log(3) / 2) = 3/4
    np.testing.assert_allclose(kda_gate(g, A_log=np.log([2.0]), dt_bias=np.full(2, math.log(3.0) / 2),
                                        lower_bound=-1.0), -0.75, rtol=1e-14)
    # far from 0 the gates stay finite: softplus(x) ~ x, sigmoid saturates at the bound
    np.testing.assert_allclose(kda_gate(g + 800.0, A_log=np.zeros(1)), -800.0, rtol=1e-15)
    np.testing.assert_allclose(kda_gate(g + 800.0, lower_bound=-4.0), -4.0, rtol=1e-15)
    np.testing.assert_array_equal(kda_gate(g - 800.0, lower_bound=-4.0), 0.0)


def test_gate_is_applied_inside_kda():
    rng = np.random.default_rng(213)
    q, k, v, g, beta = _inputs(rng, 9)
    raw = rng.standard_normal(g.shape)
    gate = dict(A_log=rng.standard_normal(HV), dt_bias=rng.standard_normal(HV * K), lower_bound=-3.0)
    outs = kda(q, k, v, raw, beta, checkpoint_cu=[0, 1], checkpoint_offsets=[4], **gate)
    outs_pre = kda(q, k, v, kda_gate(raw, **gate), beta, checkpoint_cu=[0, 1], checkpoint_offsets=[4])
    for out, out_pre in zip(outs, outs_pre):
        np.testing.assert_array_equal(out, out_pre)


def _bad_cases():
    rng = np.random.default_rng(214)
    q, k, v, g, beta = _inputs(rng, 10, head_k=8, head_v=6)
    base = dict(q=q, k=k, v=v, g=g, beta=beta)
    return [
        ("q", dict(base, q=q[..., None])),
        ("q", dict(base, q=q.astype(np.int16))),
        ("k", dict(base, k=k[:9])),
        ("v", dict(base, v=v[:, :3])),
        ("v", dict(base, v=v[:, :, None])),
        ("g", dict(base, g=g[:, :, 0])),
        ("g", dict(base, g=g[:, :, :4])),
        ("g", dict(base, g=g.astype(np.complex64))),
        ("beta", dict(base, beta=beta[:, :, None])),
        ("initial_state", dict(base, initial_state=np.zeros((1, HV, 6, 8)))),
        ("initial_state", dict(base, initial_state=np.zeros((1, HV, 8, 6)), state_layout="vk")),
        ("state_layout", dict(base, state_layout="KV")),
        ("cu_seqlens", dict(base, cu_seqlens=[0, 11])),
        ("checkpoint_offsets", dict(base, checkpoint_cu=[0, 1], checkpoint_offsets=[0])),
        ("checkpoint_cu", dict(base, checkpoint_cu=[0, 2], checkpoint_offsets=[4])),
        ("lower_bound", dict(base, lower_bound=-6.0)),
        ("lower_bound", dict(base, lower_bound=0.0)),
        ("lower_bound", dict(base, lower_bound=0.5)),
        ("lower_bound", dict(base, lower_bound=float("nan"))),
        ("A_log", dict(base, A_log=np.zeros(HV + 1))),
        ("A_log", dict(base, A_log=np.zeros(HV, np.int32))),
        ("dt_bias", dict(base, A_log=np.zeros(HV), dt_bias=np.zeros((HV, 4)))),
        ("dt_bias", dict(base, lower_bound=-5.0, dt_bias=np.zeros(HV * 8 + 1))),
        ("dt_bias", dict(base, dt_bias=np.zeros((HV, 8)))),
    ]


@pytest.mark.parametrize("name,kwargs", _bad_cases())
def test_bad_input_names_the_argument(name, kwargs):
    args = [kwargs.pop(x) for x in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        kda(*args, **kwargs)
