"""The float64 SSD reference against its own semantics and against closed forms that share none of its token loop."""

import ml_dtypes
import numpy as np
import pytest

from jaxckpt.ops.ssd.reference import ssd

H, P, N = 4, 4, 8


def make_inputs(rng, num_tokens, num_groups, *, num_rows=1):
    return dict(
        x=rng.normal(size=(num_tokens, H, P)),
        dt=rng.normal(-1.0, 1.0, size=(num_tokens, H)),
        A=-np.exp(rng.uniform(-1.0, 1.0, size=H)),
        B=rng.normal(size=(num_tokens, num_groups, N)),
        C=rng.normal(size=(num_tokens, num_groups, N)),
        D=rng.normal(size=H),
        dt_bias=rng.normal(0.0, 0.5, size=H),
        z=rng.normal(size=(num_tokens, H, P)),
        initial_state=rng.normal(size=(num_rows, H, P, N)),
    )


def softplus(v):
    return np.logaddexp(0.0, v)


def segsum(a):
    """[..., T] -> [..., T, T]: out[i, j] = sum_{j < s <= i} a_s for j <= i, -inf above (mamba's ssd_minimal)."""
    length = a.shape[-1]
    repeated = np.repeat(a[..., None], length, axis=-1)  # [..., i, j] = a_i
    strictly_lower = np.tril(np.ones((length, length), bool), -1)
    sums = np.cumsum(np.where(strictly_lower, repeated, 0.0), axis=-2)
    return np.where(np.tril(np.ones((length, length), bool)), sums, -np.inf)


def quadratic_form(x, dt, A, B, C, D, dt_bias, z, initial_state):
    """One row in the "SSD minimal" quadratic form; returns (y, states after every prefix [T + 1, H, P, N])."""
    num_tokens = x.shape[0]
    repeat = H // B.shape[1]
    B_heads, C_heads = np.repeat(B, repeat, axis=1), np.repeat(C, repeat, axis=1)  # [T, H, N]
    delta = softplus(dt + dt_bias)  # [T, H]
    a = (delta * A).T  # [H, T]
    L = np.exp(segsum(a))  # [H, T, T]
    scores = np.einsum("ihn,jhn->hij", C_heads, B_heads) * L
    y = np.einsum("hij,jhp->ihp", scores, delta[:, :, None] * x)
    cumulative = np.cumsum(a, axis=1)  # [H, T]
    y += np.einsum("hi,hpn,ihn->ihp", np.exp(cumulative), initial_state, C_heads)
    y += D[None, :, None] * x
    y *= z / (1.0 + np.exp(-z))
    # The state after the first r tokens: decayed initial state plus row r - 1 of L applied to the updates.
    states = [initial_state]
    for r in range(1, num_tokens + 1):
        weights = L[:, r - 1, :r] * delta[:r].T  # [H, r]
        states.append(np.exp(cumulative[:, r - 1])[:, None, None] * initial_state
                      + np.einsum("hj,jhp,jhn->hpn", weights, x[:r], B_heads[:r]))
    return y, np.stack(states)


@pytest.mark.parametrize("num_groups", [1, 2])
def test_matches_quadratic_form(num_groups):
    rng = np.random.default_rng(101 + num_groups)
    inputs = make_inputs(rng, 37, num_groups)
    offsets = np.array([1, 9, 16, 36])
    y, final, ckpt = ssd(**inputs, checkpoint_cu=[0, offsets.size], checkpoint_offsets=offsets)
    expect_y, states = quadratic_form(**{k: v for k, v in inputs.items() if k != "initial_state"},
                                      initial_state=inputs["initial_state"][0])
    np.testing.assert_allclose(y, expect_y, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(final[0], states[-1], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ckpt, states[offsets], rtol=1e-10, atol=1e-12)


def test_constant_decay_closed_form():
    """Constant delta, x, B, C: H_t = r^t H_0 + delta (1 - r^t) / (1 - r) x B^T, a geometric series."""
    rng = np.random.default_rng(102)
    num_tokens, delta = 25, 0.3
    A = -rng.uniform(0.2, 1.5, size=H)
    x1, B1, C1 = rng.normal(size=(H, P)), rng.normal(size=N), rng.normal(size=N)
    D = rng.normal(size=(H, P))
    h0 = rng.normal(size=(1, H, P, N))
    # dt_limit = (delta, delta) pins delta whatever dt is, which exercises the clamp.
    y, final, ckpt = ssd(np.broadcast_to(x1, (num_tokens, H, P)), rng.normal(size=(num_tokens, H)), A,
                         np.broadcast_to(B1, (num_tokens, 1, N)), np.broadcast_to(C1, (num_tokens, 1, N)),
                         D=D, dt_limit=(delta, delta), initial_state=h0, checkpoint_cu=[0, 1], checkpoint_offsets=[7])
    r = np.exp(delta * A)  # [H]
    t = np.arange(num_tokens + 1)[:, None]
    powers = r[None, :] ** t  # [T + 1, H]
    states = (powers[:, :, None, None] * h0[0]
              + (delta * (1 - powers) / (1 - r))[:, :, None, None] * np.einsum("hp,n->hpn", x1, B1))
    np.testing.assert_allclose(final[0], states[-1], rtol=1e-11)
    np.testing.assert_allclose(ckpt[0], states[7], rtol=1e-11)
    np.testing.assert_allclose(y, np.einsum("thpn,n->thp", states[1:], C1) + D * x1, rtol=1e-10, atol=1e-12)


def test_softplus_passes_large_values_through():
    """Above 20 delta is dt + dt_bias itself (mamba_ssm); one token from a zero state gives y = delta x (B.C)."""
    rng = np.random.default_rng(103)
    pre = np.array([[19.5, 20.0, 20.5, 30.0]])  # [1, H]
    dt_bias = np.array([0.25, -0.5, 1.0, 0.0])
    x, B, C = rng.normal(size=(1, H, P)), rng.normal(size=(1, 1, N)), rng.normal(size=(1, 1, N))
    y, _, _ = ssd(x, pre - dt_bias, -np.ones(H), B, C, dt_bias=dt_bias)
    delta = np.where(pre > 20, pre, np.log1p(np.exp(pre)))[0]
    assert delta[2] == 20.5 and delta[3] == 30.0 and delta[1] != 20.0
    np.testing.assert_allclose(y[0], delta[:, None] * x[0] * (B[0, 0] @ C[0, 0]), rtol=1e-12)


@pytest.mark.parametrize("num_groups", [1, 2])
def test_checkpoint_is_prefix_final_state_and_continuation(num_groups):
    rng = np.random.default_rng(104 + num_groups)
    inputs = make_inputs(rng, 45, num_groups)
    offsets = [3, 20, 44]
    y, final, ckpt = ssd(**inputs, dt_limit=(0.01, 2.0), checkpoint_cu=[0, 3], checkpoint_offsets=offsets)
    for m, p in enumerate(offsets):
        head = {k: (v[:p] if k not in ("A", "D", "dt_bias", "initial_state") else v) for k, v in inputs.items()}
        tail = {k: (v[p:] if k not in ("A", "D", "dt_bias", "initial_state") else v) for k, v in inputs.items()}
        _, head_final, _ = ssd(**head, dt_limit=(0.01, 2.0))
        np.testing.assert_allclose(ckpt[m], head_final[0], rtol=1e-12, atol=1e-13)
        tail["initial_state"] = ckpt[m:m + 1]
        tail_y, tail_final, _ = ssd(**tail, dt_limit=(0.01, 2.0))
        np.testing.assert_allclose(tail_y, y[p:], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(tail_final, final, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("with_initial", [False, True])
def test_row_in_batch_equals_row_alone(with_initial):
    rng = np.random.default_rng(105 + with_initial)
    lengths = [13, 0, 1, 30, 7]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    num_tokens = int(cu[-1]) + 3  # three padding tokens
    inputs = make_inputs(rng, num_tokens, 2, num_rows=len(lengths))
    if not with_initial:
        inputs.pop("initial_state")
    ccu = [0, 2, 2, 2, 5, 6]
    offsets = [4, 12, 1, 15, 29, 6, 0, 0]  # two padded entries
    y, final, ckpt = ssd(**inputs, cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets)
    for n, length in enumerate(lengths):
        start, end = cu[n], cu[n + 1]
        row = {k: (v[start:end] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inputs.items()}
        if with_initial:
            row["initial_state"] = inputs["initial_state"][n:n + 1]
        row_offsets = offsets[ccu[n]:ccu[n + 1]]
        row_y, row_final, row_ckpt = ssd(**row, checkpoint_cu=[0, len(row_offsets)], checkpoint_offsets=row_offsets)
        np.testing.assert_array_equal(y[start:end], row_y)
        np.testing.assert_array_equal(final[n], row_final[0])
        np.testing.assert_array_equal(ckpt[ccu[n]:ccu[n + 1]], row_ckpt)
    expect_empty = inputs["initial_state"][1] if with_initial else np.zeros((H, P, N))
    np.testing.assert_array_equal(final[1], expect_empty)
    np.testing.assert_array_equal(y[cu[-1]:], 0.0)
    np.testing.assert_array_equal(ckpt[6:], 0.0)


def test_state_layouts_agree():
    rng = np.random.default_rng(107)
    inputs = make_inputs(rng, 20, 2, num_rows=2)
    h0 = inputs.pop("initial_state")
    options = dict(cu_seqlens=[0, 8, 20], checkpoint_cu=[0, 1, 3], checkpoint_offsets=[5, 2, 11, 0])
    y_vk, final_vk, ckpt_vk = ssd(**inputs, initial_state=h0, state_layout="vk", **options)
    y_kv, final_kv, ckpt_kv = ssd(**inputs, initial_state=np.swapaxes(h0, -1, -2), state_layout="kv", **options)
    assert final_kv.shape == (2, H, N, P) and ckpt_kv.shape == (4, H, N, P)
    np.testing.assert_array_equal(y_vk, y_kv)
    np.testing.assert_array_equal(final_vk, np.swapaxes(final_kv, -1, -2))
    np.testing.assert_array_equal(ckpt_vk, np.swapaxes(ckpt_kv, -1, -2))


def test_skip_and_gate():
    rng = np.random.default_rng(108)
    inputs = make_inputs(rng, 16, 1)
    z, D = inputs.pop("z"), inputs.pop("D")
    plain, _, _ = ssd(**inputs)
    gated, _, _ = ssd(**inputs, z=z, D=D)
    per_channel, _, _ = ssd(**inputs, z=z, D=np.repeat(D[:, None], P, axis=1))
    np.testing.assert_allclose(gated, (plain + D[:, None] * inputs["x"]) * z / (1 + np.exp(-z)), rtol=1e-12,
                               atol=1e-14)
    np.testing.assert_array_equal(gated, per_channel)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_inputs_compute_in_float64(dtype):
    rng = np.random.default_rng(109)
    inputs = {k: v.astype(dtype) for k, v in make_inputs(rng, 12, 2).items()}
    outputs = ssd(**inputs)
    expected = ssd(**{k: v.astype(np.float64) for k, v in inputs.items()})
    for out, exp in zip(outputs, expected):
        assert out.dtype == np.float64
        np.testing.assert_array_equal(out, exp)


BAD_INPUTS = [
    ("x", dict(x=np.zeros((6, H)))),
    ("x", dict(x=np.zeros((6, H, P), np.int32))),
    ("dt", dict(dt=np.zeros((5, H)))),
    ("dt", dict(dt=np.zeros((6, H), np.complex128))),
    ("A", dict(A=np.zeros(H + 1))),
    ("B", dict(B=np.zeros((5, 1, N)))),
    ("B", dict(B=np.zeros((6, 3, N)), C=np.zeros((6, 3, N)))),
    ("C", dict(C=np.zeros((6, 1, N + 1)))),
    ("D", dict(D=np.zeros((H, P + 1)))),
    ("dt_bias", dict(dt_bias=np.zeros(2))),
    ("z", dict(z=np.zeros((6, H, P + 1)))),
    ("dt_limit", dict(dt_limit=(1.0, 0.5))),
    ("dt_limit", dict(dt_limit=(0.1,))),
    ("initial_state", dict(initial_state=np.zeros((2, H, P, N)))),
    ("initial_state", dict(initial_state=np.zeros((1, H, P, N)), state_layout="kv")),
    ("state_layout", dict(state_layout="pn")),
    ("cu_seqlens", dict(cu_seqlens=[0, 4, 3])),
    ("cu_seqlens", dict(cu_seqlens=[0, 7])),
    ("checkpoint_cu", dict(checkpoint_cu=[0, 1])),
    ("checkpoint_offsets", dict(checkpoint_cu=[0, 1], checkpoint_offsets=[6])),
    ("checkpoint_offsets", dict(checkpoint_cu=[0, 1], checkpoint_offsets=[2, 3])),
]


@pytest.mark.parametrize("name, override", BAD_INPUTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(name, override):
    inputs = dict(x=np.zeros((6, H, P)), dt=np.zeros((6, H)), A=-np.ones(H), B=np.zeros((6, 1, N)),
                  C=np.zeros((6, 1, N)))
    with pytest.raises(ValueError, match=f"^{name}"):
        ssd(**{**inputs, **override})
