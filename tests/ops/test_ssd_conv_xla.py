"""The chunk-parallel XLA SSD and conv1d against the float64 token-by-token references, and their jax.grad; SSD's
associative and sequential state passes agree."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxckpt.ops.conv1d import reference as conv_reference
from jaxckpt.ops.conv1d import xla as conv_xla
from jaxckpt.ops.ssd import reference as ssd_reference
from jaxckpt.ops.ssd import xla as ssd_xla
from jaxckpt.plan.conventions import PAD_CHECKPOINT_OFFSET, validate_checkpoints
from tests.numerics import rel_rms

H, P, N = 4, 8, 16
CONV_DIM = 8
# empty rows, length-1 rows, rows shorter than a conv window, rows spanning several 16-token chunks
LENGTHS = (0, 1, 37, 2, 70, 0, 17)
# one compile per configuration instead of op-by-op dispatch; the metadata arrays are traced
ssd = jax.jit(ssd_xla.ssd,
              static_argnames=("dt_limit", "state_layout", "chunk_size", "checkpoint_method", "state_pass"))
causal_conv1d = jax.jit(conv_xla.causal_conv1d, static_argnames=("activation",))


def _rows(rng, lengths, *, pad_tokens=3, pad_checkpoints=2):
    """cu_seqlens, CSR checkpoints (offsets 1 and len - 1 plus random ones, then padded entries) and T."""
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    per_row = []
    for length in lengths:
        if length < 2:
            per_row.append([])
            continue
        inner = rng.choice(np.arange(1, length), size=min(2, length - 1), replace=False)
        per_row.append(sorted({1, length - 1, *inner.tolist()}))
    ccu = np.concatenate([[0], np.cumsum([len(o) for o in per_row])]).astype(np.int32)
    offsets = np.array([o for row in per_row for o in row] + [PAD_CHECKPOINT_OFFSET] * pad_checkpoints, np.int32)
    validate_checkpoints(ccu, offsets, cu)
    return cu, ccu, offsets, int(cu[-1]) + pad_tokens


def _assert_close(outputs, expected, tol):
    for name, actual, want in zip(("y", "final_state", "checkpoint_states"), outputs, expected):
        err = rel_rms(actual, want)
        assert err <= tol, f"{name}: rel-RMS {err:.3g} > {tol}"


def _ssd_inputs(rng, num_tokens, num_rows, *, groups, dtype=np.float32, strong_decay=False):
    shift = 1.0 if strong_decay else -1.0
    inputs = dict(
        x=rng.standard_normal((num_tokens, H, P)),
        dt=rng.standard_normal((num_tokens, H)) + shift,
        A=-np.exp(rng.uniform(0.0, 1.5 if strong_decay else 0.5, H)),
        B=rng.standard_normal((num_tokens, groups, N)) / 4,
        C=rng.standard_normal((num_tokens, groups, N)) / 4,
    )
    inputs = {k: v.astype(dtype) for k, v in inputs.items()}
    initial = rng.standard_normal((num_rows, H, P, N)) * (rng.random(num_rows) < 0.6)[:, None, None, None]
    return inputs, initial.astype(np.float32)


SSD_CASES = [
    dict(chunk_size=16, groups=1, state_layout="vk", D="head", z=True, dt_limit=None, big_dt=True),
    dict(chunk_size=16, groups=2, state_layout="kv", D="channel", z=False, dt_limit=(0.01, 0.5), big_dt=False),
    dict(chunk_size=64, groups=2, state_layout="vk", D=None, z=True, dt_limit=(0.0, 3.0), big_dt=True),
    dict(chunk_size=64, groups=1, state_layout="kv", D="head", z=False, dt_limit=None, big_dt=False),
]


@pytest.mark.parametrize("method", ["in_chunk", "forced_break"])
@pytest.mark.parametrize("case", range(len(SSD_CASES)))
def test_ssd_matches_reference(case, method):
    opts = SSD_CASES[case]
    rng = np.random.default_rng(100 + case)
    cu, ccu, offsets, num_tokens = _rows(rng, LENGTHS)
    inputs, initial = _ssd_inputs(rng, num_tokens, len(LENGTHS), groups=opts["groups"],
                                  strong_decay=opts["chunk_size"] == 64)
    if opts["big_dt"]:  # the softplus pass-through branch (dt + dt_bias > 20)
        inputs["dt"][rng.choice(num_tokens, 5, replace=False), 1] = 25.0
    if opts["state_layout"] == "kv":
        initial = np.swapaxes(initial, -1, -2).copy()
    kwargs = dict(dt_bias=rng.uniform(-0.5, 0.5, H).astype(np.float32), dt_limit=opts["dt_limit"],
                  initial_state=initial, cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets,
                  state_layout=opts["state_layout"])
    if opts["D"] == "head":
        kwargs["D"] = rng.standard_normal(H).astype(np.float32)
    elif opts["D"] == "channel":
        kwargs["D"] = rng.standard_normal((H, P)).astype(np.float32)
    if opts["z"]:
        kwargs["z"] = rng.standard_normal((num_tokens, H, P)).astype(np.float32)
    expected = ssd_reference.ssd(*inputs.values(), **kwargs)
    outputs = ssd(*inputs.values(), **kwargs, chunk_size=opts["chunk_size"], checkpoint_method=method)
    assert outputs[0].dtype == jnp.float32 and outputs[1].dtype == jnp.float32
    _assert_close(outputs, expected, 1e-5)


def test_ssd_in_chunk_is_bitwise_blind_to_checkpoints_and_agrees_with_forced_break():
    rng = np.random.default_rng(7)
    cu, ccu, offsets, num_tokens = _rows(rng, LENGTHS)
    inputs, initial = _ssd_inputs(rng, num_tokens, len(LENGTHS), groups=2)
    common = dict(initial_state=initial, cu_seqlens=cu, chunk_size=16, D=np.ones(H, np.float32))
    plain = ssd(*inputs.values(), **common)
    in_chunk = ssd(*inputs.values(), **common, checkpoint_cu=ccu, checkpoint_offsets=offsets)
    forced = ssd(*inputs.values(), **common, checkpoint_cu=ccu, checkpoint_offsets=offsets,
                         checkpoint_method="forced_break")
    np.testing.assert_array_equal(np.asarray(in_chunk[0]), np.asarray(plain[0]))
    np.testing.assert_array_equal(np.asarray(in_chunk[1]), np.asarray(plain[1]))
    assert plain[2].shape == (0, H, P, N)
    for a, b in zip(in_chunk, forced):
        assert rel_rms(a, np.asarray(b, np.float64)) <= 1e-5


@pytest.mark.parametrize("method", ["in_chunk", "forced_break"])
def test_ssd_associative_and_sequential_state_passes_agree(method):
    rng = np.random.default_rng(19 + (method == "forced_break"))
    cu, ccu, offsets, num_tokens = _rows(rng, LENGTHS)
    inputs, initial = _ssd_inputs(rng, num_tokens, len(LENGTHS), groups=2)
    common = dict(initial_state=initial, cu_seqlens=cu, chunk_size=16, checkpoint_method=method)
    associative = ssd(*inputs.values(), **common, checkpoint_cu=ccu, checkpoint_offsets=offsets)
    sequential = ssd(*inputs.values(), **common, checkpoint_cu=ccu, checkpoint_offsets=offsets,
                     state_pass="sequential")
    _assert_close(sequential, [np.asarray(a, np.float64) for a in associative], 1e-6)
    if method == "in_chunk":
        without = ssd(*inputs.values(), **common, state_pass="sequential")
        np.testing.assert_array_equal(np.asarray(sequential[0]), np.asarray(without[0]))
        np.testing.assert_array_equal(np.asarray(sequential[1]), np.asarray(without[1]))


def test_ssd_jit_with_traced_metadata_compiles_once():
    rng = np.random.default_rng(11)
    traces = []

    @jax.jit
    def run(x, dt, A, B, C, initial_state, cu_seqlens, checkpoint_cu, checkpoint_offsets):
        traces.append(None)
        return ssd_xla.ssd(x, dt, A, B, C, initial_state=initial_state, cu_seqlens=cu_seqlens,
                           checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, chunk_size=16)

    for lengths in [(30, 0, 50, 1, 40), (5, 90, 2, 0, 24)]:
        cu, ccu, offsets, num_tokens = _rows(rng, lengths, pad_tokens=4)
        pad = 16 - offsets.size  # same checkpoint bucket for both batches
        offsets = np.concatenate([offsets, np.full(pad, PAD_CHECKPOINT_OFFSET, np.int32)])
        inputs, initial = _ssd_inputs(rng, num_tokens, len(lengths), groups=1)
        outputs = run(*inputs.values(), initial, cu, ccu, offsets)
        expected = ssd_reference.ssd(*inputs.values(), initial_state=initial, cu_seqlens=cu, checkpoint_cu=ccu,
                                     checkpoint_offsets=offsets)
        _assert_close(outputs, expected, 1e-5)
    assert len(traces) == 1


def test_ssd_bfloat16_inputs():
    rng = np.random.default_rng(13)
    cu, ccu, offsets, num_tokens = _rows(rng, (20, 1, 45))
    inputs, initial = _ssd_inputs(rng, num_tokens, 3, groups=2, dtype=ml_dtypes.bfloat16)
    kwargs = dict(initial_state=initial, cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets,
                  z=rng.standard_normal((num_tokens, H, P)).astype(ml_dtypes.bfloat16))
    outputs = ssd(*inputs.values(), **kwargs, chunk_size=16)
    assert outputs[0].dtype == jnp.bfloat16 and outputs[1].dtype == jnp.float32
    expected = ssd_reference.ssd(*inputs.values(), **kwargs)
    # y: bf16 operands with fp32 accumulation (the bf16 class); the states add x dt B^T through bf16x3 products and
    # decay in fp32, so they stay close to fp32 accuracy
    assert rel_rms(outputs[0], expected[0]) <= 6e-3
    _assert_close(outputs[1:], expected[1:], 1e-5)


def _ssd_token_scan(x, dt, A, B, C, D, z, dt_bias, initial, cu, ccu, offsets):
    """Plain jnp token-by-token SSD (concrete metadata) for gradient checks."""
    num_tokens = int(cu[-1])
    row = np.searchsorted(cu, np.arange(num_tokens), side="right") - 1
    starts = jnp.asarray(np.arange(num_tokens) == cu[row])
    row = jnp.asarray(row)
    delta = jax.nn.softplus(dt + dt_bias)
    reps = x.shape[1] // B.shape[1]
    Bh, Ch = jnp.repeat(B, reps, axis=1), jnp.repeat(C, reps, axis=1)

    def step(state, t):
        state = jnp.where(starts[t], initial[row[t]], state)
        state = jnp.exp(delta[t] * A)[:, None, None] * state + (delta[t][:, None] * x[t])[..., None] * Bh[t][:, None]
        return state, (jnp.einsum("hpn,hn->hp", state, Ch[t]) + D[:, None] * x[t], state)

    _, (y, states) = jax.lax.scan(step, jnp.zeros_like(initial[0]), jnp.arange(num_tokens))
    y = y * jax.nn.silu(z)
    final = jnp.stack([states[cu[n + 1] - 1] if cu[n + 1] > cu[n] else initial[n] for n in range(len(cu) - 1)])
    rows = np.repeat(np.arange(len(cu) - 1), np.diff(ccu))
    checkpoints = states[cu[rows] + offsets[:ccu[-1]] - 1]
    return y, final, checkpoints


@pytest.mark.parametrize("method", ["in_chunk", "forced_break"])
def test_ssd_gradient_matches_token_scan(method):
    rng = np.random.default_rng(17)
    lengths = (9, 0, 30, 1)
    cu, ccu, offsets, num_tokens = _rows(rng, lengths, pad_tokens=0, pad_checkpoints=0)
    with jax.enable_x64(True):
        inputs, initial = _ssd_inputs(rng, num_tokens, len(lengths), groups=2, dtype=np.float64)
        extra = (rng.standard_normal(H), rng.standard_normal((num_tokens, H, P)), rng.uniform(-0.5, 0.5, H),
                 initial.astype(np.float64))
        args = tuple(jnp.asarray(a) for a in (*inputs.values(), *extra))
        probes = [jnp.asarray(rng.standard_normal(s)) for s in
                  ((num_tokens, H, P), (len(lengths), H, P, N), (int(ccu[-1]), H, P, N))]

        def loss(outputs):
            return sum(jnp.sum(o * w) for o, w in zip(outputs, probes))

        def chunked(x, dt, A, B, C, D, z, dt_bias, initial):
            return loss(ssd_xla.ssd(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, initial_state=initial,
                                    cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets, chunk_size=16,
                                    checkpoint_method=method))

        def token(*a):
            return loss(_ssd_token_scan(*a, cu, ccu, offsets))

        argnums = tuple(range(len(args)))
        got = jax.jit(jax.grad(chunked, argnums))(*args)
        want = jax.jit(jax.grad(token, argnums))(*args)
    for name, g, w in zip(("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial"), got, want):
        assert g.dtype == jnp.float64
        assert rel_rms(g, np.asarray(w)) <= 1e-10, name


@pytest.mark.parametrize("width", [2, 3, 4])
def test_conv_matches_reference_with_exact_states(width):
    rng = np.random.default_rng(200 + width)
    cu, ccu, offsets, num_tokens = _rows(rng, LENGTHS)
    x = rng.standard_normal((num_tokens, CONV_DIM)).astype(np.float32)
    weight = rng.standard_normal((CONV_DIM, width)).astype(np.float32)
    has_state = rng.random(len(LENGTHS)) < 0.6  # initial states on some rows, zeros on the others
    initial = (rng.standard_normal((len(LENGTHS), CONV_DIM, width - 1)) * has_state[:, None, None]).astype(np.float32)
    conv_bias = rng.standard_normal(CONV_DIM).astype(np.float32)
    for bias, activation, initial_state in [(conv_bias, "silu", initial), (None, None, None)]:
        kwargs = dict(activation=activation, initial_state=initial_state, cu_seqlens=cu, checkpoint_cu=ccu,
                      checkpoint_offsets=offsets)
        expected = conv_reference.causal_conv1d(x, weight, bias, **kwargs)
        outputs = causal_conv1d(x, weight, bias, **kwargs)
        assert all(o.dtype == jnp.float32 for o in outputs)
        assert rel_rms(outputs[0], expected[0]) <= 1e-5
        for actual, want in zip(outputs[1:], expected[1:]):
            np.testing.assert_array_equal(np.asarray(actual, np.float64), want)


def test_conv_jit_with_traced_metadata_compiles_once_and_bfloat16_states_are_copies():
    rng = np.random.default_rng(19)
    traces = []

    @jax.jit
    def run(x, weight, initial_state, cu_seqlens, checkpoint_cu, checkpoint_offsets):
        traces.append(None)
        return conv_xla.causal_conv1d(x, weight, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                      checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets)

    for lengths in [(30, 0, 50, 1, 40), (5, 90, 2, 0, 24)]:
        cu, ccu, offsets, num_tokens = _rows(rng, lengths, pad_tokens=4)
        offsets = np.concatenate([offsets, np.full(16 - offsets.size, PAD_CHECKPOINT_OFFSET, np.int32)])
        x = rng.standard_normal((num_tokens, CONV_DIM)).astype(ml_dtypes.bfloat16)
        weight = rng.standard_normal((CONV_DIM, 4)).astype(ml_dtypes.bfloat16)
        initial = rng.standard_normal((len(lengths), CONV_DIM, 3)).astype(ml_dtypes.bfloat16)
        outputs = run(x, weight, initial, cu, ccu, offsets)
        expected = conv_reference.causal_conv1d(x, weight, initial_state=initial, cu_seqlens=cu, checkpoint_cu=ccu,
                                                checkpoint_offsets=offsets)
        assert all(o.dtype == jnp.bfloat16 for o in outputs)
        assert rel_rms(outputs[0], expected[0]) <= 4e-3
        for actual, want in zip(outputs[1:], expected[1:]):
            np.testing.assert_array_equal(np.asarray(actual, np.float64), want)
    assert len(traces) == 1


def _conv_rows(x, weight, bias, initial, cu, ccu, offsets):
    """Plain jnp conv, one row at a time by slicing (concrete metadata), for gradient checks."""
    width = weight.shape[1]
    ys, finals, checkpoints = [], [], []
    for n in range(len(cu) - 1):
        length = int(cu[n + 1] - cu[n])
        history = jnp.concatenate([initial[n].T, x[cu[n]:cu[n + 1]]])  # [W - 1 + len, D]
        ys.append(jax.nn.silu(bias + sum(weight[:, i] * history[i:i + length] for i in range(width))))
        finals.append(history[length:].T)
        checkpoints += [history[p:p + width - 1].T for p in offsets[ccu[n]:ccu[n + 1]]]
    return jnp.concatenate(ys), jnp.stack(finals), jnp.stack(checkpoints)


def test_conv_gradient_matches_row_slicing():
    rng = np.random.default_rng(23)
    lengths = (9, 0, 2, 30, 1)
    cu, ccu, offsets, num_tokens = _rows(rng, lengths, pad_tokens=0, pad_checkpoints=0)
    with jax.enable_x64(True):
        args = tuple(jnp.asarray(a) for a in (rng.standard_normal((num_tokens, CONV_DIM)),
                                              rng.standard_normal((CONV_DIM, 4)), rng.standard_normal(CONV_DIM),
                                              rng.standard_normal((len(lengths), CONV_DIM, 3))))
        probes = [jnp.asarray(rng.standard_normal(s)) for s in
                  ((num_tokens, CONV_DIM), (len(lengths), CONV_DIM, 3), (int(ccu[-1]), CONV_DIM, 3))]

        def loss(outputs):
            return sum(jnp.sum(o * w) for o, w in zip(outputs, probes))

        def vectorised(x, weight, bias, initial):
            return loss(conv_xla.causal_conv1d(x, weight, bias, initial_state=initial, cu_seqlens=cu,
                                               checkpoint_cu=ccu, checkpoint_offsets=offsets))

        got = jax.jit(jax.grad(vectorised, (0, 1, 2, 3)))(*args)
        want = jax.jit(jax.grad(lambda *a: loss(_conv_rows(*a, cu, ccu, offsets)), (0, 1, 2, 3)))(*args)
    for name, g, w in zip(("x", "weight", "bias", "initial_state"), got, want):
        assert rel_rms(g, np.asarray(w)) <= 1e-12, name


def test_static_validation_names_the_argument():
    rng = np.random.default_rng(29)
    inputs, _ = _ssd_inputs(rng, 10, 1, groups=2)
    x, dt, A, B, C = inputs.values()
    bad = [
        (dict(x=x[0]), "x:"),
        (dict(B=np.zeros((10, 3, N), np.float32), C=np.zeros((10, 3, N), np.float32)), "B:"),
        (dict(D=np.zeros(3, np.float32)), "D:"),
        (dict(initial_state=np.zeros((1, H, N, P), np.float32)), "initial_state:"),
        (dict(checkpoint_method="split"), "checkpoint_method:"),
        (dict(state_pass="parallel"), "state_pass:"),
        (dict(cu_seqlens=np.array([0.0, 10.0])), "cu_seqlens:"),
        (dict(checkpoint_cu=np.zeros(2, np.int32)), "checkpoint_cu and checkpoint_offsets:"),
        (dict(dt_limit=(1.0,)), "dt_limit:"),
    ]
    for override, prefix in bad:
        args = dict(x=x, dt=dt, A=A, B=B, C=C) | override
        positional = [args.pop(k) for k in ("x", "dt", "A", "B", "C")]
        with pytest.raises(ValueError, match=f"^{prefix}"):
            ssd_xla.ssd(*positional, **args)
    with pytest.raises(ValueError, match="^weight:"):
        conv_xla.causal_conv1d(np.zeros((5, CONV_DIM), np.float32), np.zeros((CONV_DIM, 5), np.float32))
    with pytest.raises(ValueError, match="^activation:"):
        conv_xla.causal_conv1d(np.zeros((5, CONV_DIM), np.float32), np.zeros((CONV_DIM, 3), np.float32),
                               activation="relu")
