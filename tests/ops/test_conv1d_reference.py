"""The float64 causal conv1d reference against np.convolve, direct slicing and its own row/checkpoint semantics."""

import ml_dtypes
import numpy as np
import pytest

from jaxckpt.ops.conv1d.reference import causal_conv1d

D = 6


def silu(v):
    return v / (1.0 + np.exp(-v))


def convolve_row(x, weight, bias, activation, state):
    """One row by np.convolve per channel over [state, x]; the kernel is flipped because convolve flips it back.

    The "full" output is sliced to the windows inside the sequence: mode="valid" swaps its arguments when the
    sequence (W - 1 values for an empty row) is shorter than the kernel.
    """
    width = weight.shape[1]
    sequence = np.concatenate([state.T, x])  # [W - 1 + len, D]
    y = np.stack([np.convolve(sequence[:, c], weight[c, ::-1])[width - 1:len(sequence)] for c in range(D)], axis=1)
    y = y + (0.0 if bias is None else bias)
    return silu(y) if activation == "silu" else y


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_matches_np_convolve_and_slicing(width, with_bias, activation):
    rng = np.random.default_rng(200 + 10 * width + 2 * with_bias + (activation is None))
    lengths = [17, 0, 1, 2, 40]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    x = rng.normal(size=(int(cu[-1]) + 2, D))
    weight = rng.normal(size=(D, width))
    bias = rng.normal(size=D) if with_bias else None
    state = rng.normal(size=(len(lengths), D, width - 1))
    ccu = [0, 3, 3, 3, 4, 6]
    offsets = [1, 2, 16, 1, 1, 39, 0]
    y, final, ckpt = causal_conv1d(x, weight, bias, activation=activation, initial_state=state, cu_seqlens=cu,
                                   checkpoint_cu=ccu, checkpoint_offsets=offsets)
    for n in range(len(lengths)):
        start, end = cu[n], cu[n + 1]
        np.testing.assert_allclose(y[start:end], convolve_row(x[start:end], weight, bias, activation, state[n]),
                                   rtol=1e-12, atol=1e-14)
        sequence = np.concatenate([state[n].T, x[start:end]])  # raw position p sits at index p + W - 1
        np.testing.assert_array_equal(final[n], sequence[len(sequence) - (width - 1):].T)
        for m in range(ccu[n], ccu[n + 1]):
            p = offsets[m]
            np.testing.assert_array_equal(ckpt[m], sequence[p:p + width - 1].T)
    np.testing.assert_array_equal(y[cu[-1]:], 0.0)
    np.testing.assert_array_equal(ckpt[6:], 0.0)


@pytest.mark.parametrize("width", [2, 4])
def test_checkpoint_is_prefix_final_state_and_continuation(width):
    rng = np.random.default_rng(210 + width)
    x, weight, bias = rng.normal(size=(30, D)), rng.normal(size=(D, width)), rng.normal(size=D)
    state = rng.normal(size=(1, D, width - 1))
    offsets = [1, 2, 3, 17, 29]
    y, final, ckpt = causal_conv1d(x, weight, bias, initial_state=state, checkpoint_cu=[0, 5],
                                   checkpoint_offsets=offsets)
    for m, p in enumerate(offsets):
        _, head_final, _ = causal_conv1d(x[:p], weight, bias, initial_state=state)
        np.testing.assert_array_equal(ckpt[m], head_final[0])
        tail_y, tail_final, _ = causal_conv1d(x[p:], weight, bias, initial_state=ckpt[m:m + 1])
        np.testing.assert_array_equal(tail_y, y[p:])
        np.testing.assert_array_equal(tail_final, final)


@pytest.mark.parametrize("with_initial", [False, True])
def test_row_in_batch_equals_row_alone(with_initial):
    rng = np.random.default_rng(220 + with_initial)
    width = 4
    lengths = [9, 0, 1, 2, 3, 21]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    x = rng.normal(size=(int(cu[-1]) + 4, D))
    weight, bias = rng.normal(size=(D, width)), rng.normal(size=D)
    state = rng.normal(size=(len(lengths), D, width - 1)) if with_initial else None
    ccu = [0, 1, 1, 1, 2, 4, 5]
    offsets = [8, 1, 1, 2, 20, 0, 0]
    y, final, ckpt = causal_conv1d(x, weight, bias, initial_state=state, cu_seqlens=cu, checkpoint_cu=ccu,
                                   checkpoint_offsets=offsets)
    for n in range(len(lengths)):
        start, end = cu[n], cu[n + 1]
        row_state = None if state is None else state[n:n + 1]
        row_offsets = offsets[ccu[n]:ccu[n + 1]]
        row_y, row_final, row_ckpt = causal_conv1d(x[start:end], weight, bias, initial_state=row_state,
                                                   checkpoint_cu=[0, len(row_offsets)], checkpoint_offsets=row_offsets)
        np.testing.assert_array_equal(y[start:end], row_y)
        np.testing.assert_array_equal(final[n], row_final[0])
        np.testing.assert_array_equal(ckpt[ccu[n]:ccu[n + 1]], row_ckpt)
    incoming = np.zeros((len(lengths), D, width - 1)) if state is None else state
    np.testing.assert_array_equal(final[1], incoming[1])
    # Rows shorter than W - 1 keep the tail of their incoming state, then their own inputs.
    np.testing.assert_array_equal(final[2], np.concatenate([incoming[2][:, 1:], x[cu[2]:cu[3]].T], axis=1))
    np.testing.assert_array_equal(final[3], np.concatenate([incoming[3][:, 2:], x[cu[3]:cu[4]].T], axis=1))
    np.testing.assert_array_equal(ckpt[5:], 0.0)


def test_swish_is_silu():
    rng = np.random.default_rng(230)
    x, weight = rng.normal(size=(11, D)), rng.normal(size=(D, 3))
    for a, b in zip(causal_conv1d(x, weight, activation="swish"), causal_conv1d(x, weight, activation="silu")):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_inputs_compute_in_float64(dtype):
    rng = np.random.default_rng(231)
    args = [rng.normal(size=(13, D)).astype(dtype), rng.normal(size=(D, 4)).astype(dtype),
            rng.normal(size=D).astype(dtype)]
    state = rng.normal(size=(1, D, 3)).astype(dtype)
    outputs = causal_conv1d(*args, initial_state=state)
    expected = causal_conv1d(*(a.astype(np.float64) for a in args), initial_state=state.astype(np.float64))
    for out, exp in zip(outputs, expected):
        assert out.dtype == np.float64
        np.testing.assert_array_equal(out, exp)


BAD_INPUTS = [
    ("x", dict(x=np.zeros((5, D, 1)))),
    ("x", dict(x=np.zeros((5, D), np.int64))),
    ("weight", dict(weight=np.zeros((D + 1, 4)))),
    ("weight", dict(weight=np.zeros((D, 1)))),
    ("weight", dict(weight=np.zeros((D, 5)))),
    ("weight", dict(weight=np.zeros((D, 4), np.complex64))),
    ("bias", dict(bias=np.zeros(D - 1))),
    ("bias", dict(bias=np.zeros(D, bool))),
    ("activation", dict(activation="relu")),
    ("initial_state", dict(initial_state=np.zeros((1, D, 4)))),
    ("initial_state", dict(initial_state=np.zeros((2, D, 3)))),
    ("cu_seqlens", dict(cu_seqlens=[1, 5])),
    ("checkpoint_cu", dict(checkpoint_offsets=[2])),  # the message names the pair, checkpoint_cu first
    ("checkpoint_cu", dict(checkpoint_cu=[0, 2], checkpoint_offsets=[2])),
    ("checkpoint_offsets", dict(checkpoint_cu=[0, 2], checkpoint_offsets=[3, 3])),
]


@pytest.mark.parametrize("name, override", BAD_INPUTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(name, override):
    inputs = dict(x=np.zeros((5, D)), weight=np.zeros((D, 4)))
    with pytest.raises(ValueError, match=f"^{name}"):
        causal_conv1d(**{**inputs, **override})
