"""The sequence split of the Mosaic GPU state pass (`delta_rule.pallas_mosaic_gpu.split`): the split logic with the
lanes kernel replaced by a float64 numpy emulator of its contract, against the float64 token-by-token references;
`split_lanes`, `choose_pieces` and the tuning checks; and, once `delta_rule.pallas_mosaic_gpu.state.state_lanes` is
written, the public GDN entry with the real kernel in Mosaic GPU's interpreter. State "fused" (the fused GDN kernels in
the same split): the public entry in the interpreter for P = 1, 2, 3 against float64, its declines, and its sm_90
lowering.

The emulator (`emulate_state_lanes`) follows `state_lanes`' docstring literally, map mode included (the same
recurrence over the columns of [I | 0] with U replaced by [0 | U]); it poisons everything the contract leaves
unspecified (outputs of chunks outside every lane, checkpoints of such chunks) with NaN and fails on lanes that
share a chunk. With fp32 inputs the cumsum and intra kernels (Pallas HLO interpreter) give fp32 intermediates, so
the split's results are held to fp32 rounding against float64, which an inexact join of the pieces would miss.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxckpt import ops
from jaxckpt.ops.common import configs
from jaxckpt.ops.delta_rule import cumsum
from jaxckpt.ops.delta_rule import pallas_triton as triton_delta
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import pipeline as gdn_mosaic
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import pipeline as kda_mosaic
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import pipeline as mosaic_delta
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import split
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import state as lanes_kernel
from jaxckpt.ops.delta_rule.reference import delta_rule_reference
from tests.numerics import rel_rms

CHUNK = 64
# rows of 0, 1, 37 (a partial chunk), 330 (5 full chunks and 10 tokens) and 129 tokens, then 7 padding tokens.
# Row 3's checkpoints: inside its first chunk (1), on every piece boundary of P = 2, 3, 4 (64, 128, 192, 256:
# chunk position 0, the piece's start state) and in its partial last chunk (329); row 4's in two chunks
CU_SEQLENS = np.array([0, 0, 1, 38, 368, 497], np.int32)
NUM_TOKENS = 504
CHECKPOINT_CU = np.array([0, 0, 0, 1, 8, 10], np.int32)
CHECKPOINT_OFFSETS = np.array([36, 1, 64, 100, 128, 192, 256, 329, 63, 128, 0, 0], np.int32)
ROWS_WITH_STATE = (1, 3)
HEAD_K, HEAD_V = 16, 32  # the emulator takes any size; K != V catches a swapped axis


def _lanes_numpy(lane_first, lane_count, chunk_start, chunk_len, decays, w, u, kd, qg, aqk, lane_init, ck, *, channel,
                 group, map_mode, o_dtype, num_tokens):
    f64 = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
    decays, w, u, kd, qg, aqk, lane_init = map(f64, (decays, w, u, kd, qg, aqk, lane_init))
    num_v_heads, num_chunks, chunk, head_k = w.shape
    head_v = u.shape[-1]
    owner = np.full(num_chunks, -1)
    for lane, (first, count) in enumerate(zip(lane_first, lane_count)):
        assert count >= 0 and (owner[first:first + count] == -1).all(), "lanes share a chunk"
        owner[first:first + count] = lane
    if map_mode:
        u = np.concatenate([np.zeros((*u.shape[:-1], head_k)), u], axis=-1)
    width = u.shape[-1]
    o = None
    if not map_mode:
        o = np.full((num_tokens, num_v_heads, head_v), np.nan)
        ends = [chunk_start[f + n - 1] + chunk_len[f + n - 1] for f, n in zip(lane_first, lane_count) if n]
        o[max(ends, default=0):] = 0  # tokens past the last lane's last chunk
    end = np.zeros((len(lane_first), num_v_heads, head_k, width))
    ckpt = None
    if ck is not None:
        ckpt = np.full((max(len(ck.checkpoint_pos), 1), num_v_heads, head_k, head_v), np.nan)
        keys, G = f64(ck.k), f64(ck.G)
    for lane, (first, count) in enumerate(zip(lane_first, lane_count)):
        for h in range(num_v_heads):
            if map_mode:
                S = np.concatenate([np.eye(head_k), np.zeros((head_k, head_v))], axis=1)
            else:
                S = np.zeros((head_k, head_v)) if lane_init is None else lane_init[lane, h]
            for c in range(first, first + count):
                v_new = u[h, c] - w[h, c] @ S
                if not map_mode:
                    length = chunk_len[c]
                    o[chunk_start[c]:chunk_start[c] + length, h] = (qg[h, c] @ S + aqk[h, c] @ v_new)[:length]
                if ck is not None:
                    start = ck.chunk_start[c]
                    k_c = keys[start:start + chunk, h // group]
                    k_c = np.concatenate([k_c, np.zeros((chunk - len(k_c), head_k))])
                    for m in range(ck.ck_start[c], ck.ck_start[c] + ck.ck_count[c]):
                        r = ck.checkpoint_pos[m]
                        assert r < ck.chunk_len[c]
                        G_r = G[h, c, r - 1] if r else 0.0 * G[h, c, 0]
                        decay = np.exp(G_r - G[h, c, :r])  # [r] or [r, K]
                        k_r = k_c[:r] * (decay if channel else decay[:, None])
                        ckpt[m, h] = (np.exp(G_r)[:, None] if channel else np.exp(G_r)) * S + k_r.T @ v_new[:r]
                d = np.exp(decays[h, c])[:, None] if channel else np.exp(decays[h, c, chunk - 1])
                S = d * S + kd[h, c].T @ v_new
            end[lane, h] = S
    if map_mode:
        return end.astype(np.float32)
    ckpt = np.full((1, num_v_heads, head_k, head_v), np.nan) if ckpt is None else ckpt
    return o.astype(o_dtype), end.astype(np.float32), ckpt.astype(np.float32)


def emulate_state_lanes(lane_first, lane_count, chunk_start, chunk_len, decays, w, u, kd, qg, aqk, lane_init,
                        checkpoints=None, *, per_channel_decay, group, num_tokens=None, map_mode=False, interpret=False,
                        state_layout="kv", state_terms=2):
    """`delta_rule.pallas_mosaic_gpu.state.state_lanes` in float64 numpy (fp32 results), through a host callback; "vk":
    lane_init and every returned state transposed. Exact arithmetic: `state_terms` (the kernel's rounding) is moot."""
    del interpret, state_terms
    CALLS.append(dict(lanes=lane_first.shape[0], map_mode=map_mode, has_init=lane_init is not None))
    if state_layout == "vk":
        kv = lambda x: x.swapaxes(-1, -2)  # noqa: E731
        lane_init = None if lane_init is None else kv(lane_init)
        out = emulate_state_lanes(lane_first, lane_count, chunk_start, chunk_len, decays, w, u, kd, qg, aqk, lane_init,
                                  checkpoints, per_channel_decay=per_channel_decay, group=group,
                                  num_tokens=num_tokens, map_mode=map_mode)
        CALLS.pop()
        return kv(out) if map_mode else (out[0], kv(out[1]), kv(out[2]))
    num_v_heads, num_chunks, chunk, head_k = w.shape
    head_v = u.shape[-1]
    lanes = lane_first.shape[0]
    if map_mode:
        assert qg is None and aqk is None and lane_init is None and checkpoints is None
        out = jax.ShapeDtypeStruct((lanes, num_v_heads, head_k, head_k + head_v), jnp.float32)
    else:
        num_ckpt = 0 if checkpoints is None else checkpoints.checkpoint_pos.shape[0]
        out = (jax.ShapeDtypeStruct((num_tokens, num_v_heads, head_v), w.dtype),
               jax.ShapeDtypeStruct((lanes, num_v_heads, head_k, head_v), jnp.float32),
               jax.ShapeDtypeStruct((max(num_ckpt, 1), num_v_heads, head_k, head_v), jnp.float32))

    def host(*args):
        arrays, ck = args[:11], args[11:]
        ck = lanes_kernel.Checkpoints(*map(np.asarray, ck)) if ck else None
        return _lanes_numpy(*map(lambda x: None if x is None else np.asarray(x), arrays), ck,
                            channel=per_channel_decay, group=group, map_mode=map_mode, o_dtype=w.dtype,
                            num_tokens=num_tokens)

    if checkpoints is not None and checkpoints.l2norm:  # the kernel's wrapper normalizes the keys it gathers
        checkpoints = checkpoints._replace(k=cumsum.l2norm(checkpoints.k), l2norm=False)
    ck_args = () if checkpoints is None else tuple(checkpoints)[:-1]  # the arrays; l2norm is False from here
    return jax.pure_callback(host, out, lane_first, lane_count, chunk_start, chunk_len, decays, w, u, kd, qg, aqk,
                             lane_init, *ck_args)


CALLS = []


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(lanes_kernel, "state_lanes", emulate_state_lanes)
    CALLS.clear()
    return CALLS


def make_case(rng, *, per_channel, dtype=np.float32, head_k=HEAD_K, head_v=HEAD_V):
    """q, k, v (1 key head, 2 value heads), an initial state on some rows; mild log decays (a few sharp drops) and
    small betas: a piece's start state still matters at its end (M far from 0), so a wrong join shows."""
    T, HV = NUM_TOKENS, 2
    g_shape = (T, HV, head_k) if per_channel else (T, HV)
    inputs = dict(q=rng.normal(size=(T, 1, head_k)), k=rng.normal(size=(T, 1, head_k)),
                  v=rng.normal(size=(T, HV, head_v)),
                  g=-rng.exponential(0.01, size=g_shape) - np.where(rng.random(g_shape) < 0.01, 1.0, 0.0),
                  beta=rng.uniform(0.02, 0.3, size=(T, HV)))
    inputs = {name: x.astype(dtype if name in "qkv" else np.float32) for name, x in inputs.items()}
    num_rows = CU_SEQLENS.size - 1
    state = rng.normal(size=(num_rows, HV, head_k, head_v)).astype(np.float32)
    state[[n for n in range(num_rows) if n not in ROWS_WITH_STATE]] = 0.0
    options = dict(initial_state=state, cu_seqlens=CU_SEQLENS, checkpoint_cu=CHECKPOINT_CU,
                   checkpoint_offsets=CHECKPOINT_OFFSETS, use_qk_l2norm=True)
    return inputs, options


def reference(inputs, options, *, per_channel):
    return delta_rule_reference(**inputs, **options, per_channel_decay=per_channel)


@pytest.fixture(scope="module", params=[False, True], ids=["gdn", "kda"])
def prepared(request):
    """A case, its float64 reference and the intermediates (`prepare`, `intra_v2` in the HLO interpreter)."""
    per_channel = request.param
    inputs, options = make_case(np.random.default_rng(11 + per_channel), per_channel=per_channel)
    inputs = {name: np.where(np.arange(NUM_TOKENS).reshape(-1, *[1] * (x.ndim - 1)) < CU_SEQLENS[-1], x, np.nan)
              for name, x in inputs.items()}  # NaN padding: nothing may read it unmasked
    clean = {name: np.nan_to_num(x) for name, x in inputs.items()}
    arrays = {name: jnp.asarray(x) for name, x in inputs.items()}
    meta = {name: jnp.asarray(options[name]) for name in ("cu_seqlens", "checkpoint_cu", "checkpoint_offsets")}
    p = cumsum.prepare(**arrays, per_channel_decay=per_channel, scale=None, use_qk_l2norm=True, **meta,
                             chunk_size=CHUNK, interpret=True)
    intermediates = triton_delta.intra_v2(p, per_channel_decay=per_channel, chunk_size=CHUNK, interpret=True)
    o, final, ckpt = reference(clean, options, per_channel=per_channel)
    return per_channel, p, intermediates, options, (o[:CU_SEQLENS[-1]], final, ckpt[:CHECKPOINT_CU[-1]])


def decays(p, per_channel):
    """What the state pass takes as each chunk's decay: KDA G's last rows [HV, NC, K], GDN G [HV, NC, C]."""
    return p.G[:, :, -1] if per_channel else p.G


def tokens(p, o):
    """The rows' tokens of the token-order output [T, HV, V], after checking that the padding tokens are zero."""
    o = np.asarray(o)
    assert o.shape[0] == p.q.shape[0], o.shape
    np.testing.assert_array_equal(o[CU_SEQLENS[-1]:], 0, err_msg="padding tokens")
    return o[:CU_SEQLENS[-1]]


@pytest.mark.parametrize("pieces", [1, 2, 3, 4, 9])
def test_state_pass_split_matches_float64(prepared, emulated, pieces):
    per_channel, p, (w, u, kd, qg, aqk), options, (o_ref, final_ref, ckpt_ref) = prepared
    init = jnp.asarray(options["initial_state"])
    o, final, ckpt = split.state_pass_split(p, w, u, kd, qg, aqk, init, decays(p, per_channel),
                                            per_channel_decay=per_channel, pieces=pieces)
    num_rows = CU_SEQLENS.size - 1
    assert [(c["lanes"], c["map_mode"]) for c in emulated] == (
        [(num_rows * pieces, False)] if pieces == 1 else [(num_rows * (pieces - 1), True), (num_rows * pieces, False)])
    num_real = CHECKPOINT_CU[-1]
    o, final, ckpt = tokens(p, o), np.asarray(final), np.asarray(ckpt)[:num_real]
    assert np.isfinite(o).all() and np.isfinite(final).all() and np.isfinite(ckpt).all()
    assert final.shape == final_ref.shape
    for name, a, r in (("o", o, o_ref), ("final", final, final_ref), ("ckpt", ckpt, ckpt_ref)):
        assert rel_rms(a, r) < 2e-5, (name, rel_rms(a, r))
    # row by row: an empty row keeps its initial state, every checkpoint on its own (a piece boundary too)
    np.testing.assert_allclose(final[0], options["initial_state"][0], atol=0)
    for m in range(num_real):
        assert rel_rms(ckpt[m], ckpt_ref[m]) < 2e-5, (m, CHECKPOINT_OFFSETS[m])


def test_pieces_agree_with_one_piece(prepared, emulated):
    # the join is exact: pieces change the results by the fp32 rounding of the maps and the scan only
    per_channel, p, (w, u, kd, qg, aqk), options, _ = prepared
    run = lambda pieces, init: split.state_pass_split(p, w, u, kd, qg, aqk, init, decays(p, per_channel),  # noqa: E731
                                                      per_channel_decay=per_channel, pieces=pieces)
    for init in (jnp.asarray(options["initial_state"]), None):
        one = run(1, init)
        four = run(4, init)
        assert emulated[-2]["map_mode"] and emulated[-1]["has_init"]
        np.testing.assert_allclose(tokens(p, four[0]), tokens(p, one[0]), rtol=0, atol=2e-5)
        np.testing.assert_allclose(four[1], one[1], rtol=0, atol=2e-5)
        np.testing.assert_allclose(np.asarray(four[2])[:CHECKPOINT_CU[-1]], np.asarray(one[2])[:CHECKPOINT_CU[-1]],
                                   rtol=0, atol=2e-5)


def test_split_lanes_properties():
    counts = np.array([0, 1, 2, 3, 5, 8, 17, 0, 64], np.int32)
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    for pieces in (1, 2, 3, 4, 8, 20):
        lane_first, lane_count = map(np.asarray, split.split_lanes(firsts, counts, pieces=pieces))
        assert lane_first.shape == lane_count.shape == (counts.size * pieces,)
        lane_first, lane_count = lane_first.reshape(-1, pieces), lane_count.reshape(-1, pieces)
        # contiguous, in order, covering each row exactly; balanced to within one chunk
        np.testing.assert_array_equal(lane_first[:, 0], firsts)
        np.testing.assert_array_equal(lane_first[:, 1:], lane_first[:, :-1] + lane_count[:, :-1])
        np.testing.assert_array_equal(lane_count.sum(axis=1), counts)
        assert (lane_count.max(axis=1) - lane_count.min(axis=1) <= 1).all()
    # traced metadata, static lane count
    traced = jax.jit(lambda f, c: split.split_lanes(f, c, pieces=3))(jnp.asarray(firsts), jnp.asarray(counts))
    np.testing.assert_array_equal(traced[1], split.split_lanes(firsts, counts, pieces=3)[1])


def test_choose_pieces_examples():
    choose = split.choose_pieces
    # one long row, 16 heads, K = V = 128 on an H200: 32 CTAs; P = 4 is the cost model's best (docstring)
    assert choose(1, 16, 128, 8192, num_sms=132) == 4
    assert choose(1, 16, 128, 32768, num_sms=132) == 4
    # the SMs are already mostly busy: no split
    assert choose(8, 32, 128, 32768, num_sms=132) == 1
    assert choose(2, 32, 128, 65536, num_sms=132) == 1
    # too short to keep 8 chunks per piece
    assert choose(1, 16, 128, 512, num_sms=132) == 1
    # 16 chunks: P = 2 fits one wave per pass but saves nothing (8 + 8 steps)
    assert choose(1, 16, 128, 1024, num_sms=132) == 1
    # few CTAs: deeper splits pay off; never more than 8
    assert choose(1, 2, 64, 1 << 20, num_sms=132) == 8
    assert choose(1, 4, 64, 1 << 20, head_k=128, num_sms=132) == 8
    # off a GPU the H200's SM count is assumed
    assert choose(1, 16, 128, 8192) == choose(1, 16, 128, 8192, num_sms=132)
    for args in [(1, 16, 128, 8192), (3, 8, 64, 30000), (1, 1, 64, 64)]:
        assert choose(*args, num_sms=132) in (1, 2, 4, 8)


def test_tuning_checks():
    rng = np.random.default_rng(5)
    inputs, _ = make_case(rng, per_channel=False, dtype=ml_dtypes.bfloat16)
    inputs = dict({name: jnp.asarray(x) for name, x in inputs.items()},
                  q=jnp.zeros((NUM_TOKENS, 1, 64), jnp.bfloat16), k=jnp.zeros((NUM_TOKENS, 1, 64), jnp.bfloat16),
                  v=jnp.zeros((NUM_TOKENS, 2, 64), jnp.bfloat16))
    ok = lambda **tuning: gdn_mosaic.supports(**inputs, interpret=True, **tuning)  # noqa: E731
    assert ok() is None and ok(state="v2") is None and ok(state="fused") is None
    assert ok(state="fused", pieces=3) is None and ok(state="fused", pieces="auto", num_stages=3) is None
    assert ok(state="v2", pieces=4) is None and ok(state="v2", pieces="auto") is None
    assert "state must be one of" in ok(state="v3") and "state must be one of" in ok(state="v1")
    for bad in (0, -2, 2.0, True, "4", configs.MAX_MOSAIC_PIECES + 1):
        assert "pieces must be an int in [1, 64] or 'auto'" in ok(state="v2", pieces=bad), bad
    # None: the default
    assert ok(state=None, pieces=None, intra_inverse=None) is None and ok(pieces=np.int32(2)) is None
    assert ok(pieces=2) is None  # state left out: "v2"
    with pytest.raises(ValueError, match="state must be one of"):
        gdn_mosaic.gated_delta_rule(**inputs, interpret=True, state="v1")
    assert {"state", "pieces"} <= set(mosaic_delta.TUNING_KEYS)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_delta_rule_mosaic_state_v2_wiring(emulated, per_channel):
    # the public pipeline's wiring with the emulated kernel: state "v2" with pieces and "auto", "vk" layout, bf16
    rng = np.random.default_rng(21 + per_channel)
    # the pipeline's intra kernels take K, V in (64, 128) (the emulated state pass any size)
    inputs, options = make_case(rng, per_channel=per_channel, dtype=ml_dtypes.bfloat16, head_k=64, head_v=128)
    options["initial_state"] = options["initial_state"].swapaxes(-1, -2).copy()
    expected = reference(inputs, dict(options, state_layout="vk"), per_channel=per_channel)
    arrays = {name: jnp.asarray(x) for name, x in inputs.items()}
    meta = {name: jnp.asarray(x) for name, x in options.items() if name != "use_qk_l2norm"}
    for pieces in (3, "auto"):
        emulated.clear()
        got = mosaic_delta.delta_rule_mosaic(**arrays, **meta, per_channel_decay=per_channel, use_qk_l2norm=True,
                                             state_layout="vk", interpret=True, state="v2", pieces=pieces)
        # "auto" on 5 short rows, 2 heads: too few chunks per row for a split
        assert [c["map_mode"] for c in emulated] == ([True, False] if pieces == 3 else [False])
        for name, a, r in zip(("o", "final", "ckpt"), got, expected):
            a = np.asarray(a, np.float32)
            assert a.shape == r.shape and np.isfinite(a).all(), name
            assert rel_rms(a, r) < 6e-3, (name, pieces, rel_rms(a, r))  # the bf16 class
        assert not np.asarray(got[0], np.float32)[CU_SEQLENS[-1]:].any()
        assert not np.asarray(got[2])[CHECKPOINT_CU[-1]:].any()


@pytest.mark.interpret
@pytest.mark.parametrize("op,pieces", [("gdn", 2), ("kda", 4)])
def test_public_entry_state_v2_pieces_in_the_interpreter(op, pieces):
    # the real lanes kernel in Mosaic GPU's interpreter through the public entry, at its sizes (K = V = 64): row 1 has
    # 3 chunks and a checkpoint on the P = 2 piece boundary (128); with P = 4 every row has empty pieces
    rng = np.random.default_rng(31)
    T, HV, D = 200, 2, 64
    cu = np.array([0, 1, 150, 190], np.int32)
    g_shape = (T, HV, D) if op == "kda" else (T, HV)
    inputs = dict(q=rng.normal(size=(T, 1, D)), k=rng.normal(size=(T, 1, D)), v=rng.normal(size=(T, HV, D)),
                  g=-rng.exponential(0.1, size=g_shape), beta=rng.uniform(0.05, 0.95, size=(T, HV)))
    inputs = {name: x.astype(ml_dtypes.bfloat16 if name in "qkv" else np.float32) for name, x in inputs.items()}
    state = rng.normal(size=(3, HV, D, D)).astype(np.float32)
    state[0] = 0.0
    options = dict(initial_state=state, cu_seqlens=cu, checkpoint_cu=np.array([0, 0, 3, 4], np.int32),
                   checkpoint_offsets=np.array([1, 64, 128, 20], np.int32), use_qk_l2norm=True)
    entry = ops.kda if op == "kda" else ops.gated_delta_rule
    expected = entry(**inputs, **options, implementation="reference")
    try:
        got = entry(**{name: jnp.asarray(x) for name, x in inputs.items()}, **options,
                    config=ops.DeltaPallasMosaicGpuConfig(pieces=pieces, interpret=True))
    except NotImplementedError as error:
        if "not written" not in str(error):
            raise
        pytest.skip("delta_rule.pallas_mosaic_gpu.state.state_lanes: kernel not written yet")
    for name, a, r in zip(("o", "final", "ckpt"), got, expected):
        a = np.asarray(a, np.float32)
        assert a.shape == r.shape and np.isfinite(a).all(), name
        assert rel_rms(a, r) < 6e-3, (name, rel_rms(a, r))


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_split_lowers_for_sm90(per_channel):
    # both passes (map and main, checkpoints included) lower for sm_90 at a real shape, (1, 8192, 16) K = V = 128,
    # without a GPU; the Triton cumsum and intra launches are left out (their lowering needs a GPU device)
    from jax import export

    from jaxckpt.plan.layout import chunk_layout

    T, H, D = 8192, 16, 128
    NC = T // CHUNK + 1
    arg = jax.ShapeDtypeStruct
    bf = jnp.bfloat16

    def fn(cu, ccu, offsets, q, k, G, w, u, kd, qg, aqk, init):
        lay = chunk_layout(cu, ccu, offsets, chunk_size=CHUNK, num_tokens=T, xp=jnp)
        p = cumsum.Prepared(q, k, None, None, G, lay, cu, ccu, 1.0, bf)
        return split.state_pass_split(p, w, u, kd, qg, aqk, init, decays(p, per_channel),
                                      per_channel_decay=per_channel, pieces=4)

    tile = lambda width: arg((H, NC, CHUNK, width), bf)  # noqa: E731
    args = (arg((2,), jnp.int32), arg((2,), jnp.int32), arg((3,), jnp.int32), arg((T, H, D), bf), arg((T, H, D), bf),
            arg((H, NC, CHUNK, D) if per_channel else (H, NC, CHUNK), jnp.float32), tile(D), tile(D), tile(D),
            tile(D), tile(CHUNK), arg((1, H, D, D), jnp.float32))
    module = export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    assert "delta_state_lanes_map" in module and "delta_state_lanes" in module.replace("delta_state_lanes_map", "")


def test_state_fused_declines():
    # KDA (per-channel decay), the intra options it replaces, and whatever the fused kernels decline
    T, D = 128, 64
    bf = lambda *shape: jnp.zeros(shape, jnp.bfloat16)  # noqa: E731
    q, v, beta = bf(T, 1, D), bf(T, 2, D), jnp.zeros((T, 2), jnp.float32)
    reason = kda_mosaic.supports(q, q, v, jnp.zeros((T, 2, D), jnp.float32), beta, interpret=True, state="fused")
    assert reason.startswith("tuning: state='fused' is the fused GDN pass") and "KDA" in reason, reason
    assert kda_mosaic.supports(q, q, v, jnp.zeros((T, 2, D), jnp.float32), beta, interpret=True, state="v2") is None
    gdn = lambda **tuning: gdn_mosaic.supports(q, q, v, beta, beta, **tuning)  # noqa: E731
    for option in ({"intra_inverse": "blocked"}, {"kda_score_parts": 2}):
        reason = gdn(interpret=True, state="fused", **option)
        assert reason.startswith("tuning:") and "state='fused' replaces" in reason, (option, reason)
    # off a GPU without the interpreter: the fused kernels' own reason comes through
    assert gdn(state="fused").startswith("state pass (fused): backend"), gdn(state="fused")
    with pytest.raises(ValueError, match="not KDA"):
        mosaic_delta.delta_rule_mosaic(q, q, v, jnp.zeros((T, 2, D)), beta, per_channel_decay=True, interpret=True,
                                       state="fused")


# rows of 1, 0, 149 (3 chunks: 64, 64, 21) and 40 tokens, then 10 NaN padding tokens. Row 2's checkpoints: inside its
# first chunk (1), on both piece boundaries of P = 3 (64, 128: chunk position 0, the piece's start state) and in its
# partial last chunk (148); row 3's at 20. With P = 3 rows 0, 1 and 3 have empty pieces (P = 2 would add no case).
FUSED_CU = np.array([0, 1, 1, 150, 190], np.int32)
FUSED_CKPT_CU = np.array([0, 0, 0, 4, 5], np.int32)
FUSED_OFFSETS = np.array([1, 64, 128, 148, 20, 0], np.int32)  # one padded entry


@pytest.fixture(scope="module")
def fused_case():
    rng = np.random.default_rng(41)
    T, HV, D = 200, 2, 64
    inputs = dict(q=rng.normal(size=(T, 1, D)), k=rng.normal(size=(T, 1, D)), v=rng.normal(size=(T, HV, D)),
                  g=-rng.exponential(0.02, size=(T, HV)), beta=rng.uniform(0.05, 0.95, size=(T, HV)))
    inputs = {name: x.astype(ml_dtypes.bfloat16 if name in "qkv" else np.float32) for name, x in inputs.items()}
    state = rng.normal(size=(4, HV, D, D)).astype(np.float32)
    state[2] = 0.0  # the long row starts from zeros, the empty row from a state it must keep
    options = dict(initial_state=state, cu_seqlens=FUSED_CU, checkpoint_cu=FUSED_CKPT_CU,
                   checkpoint_offsets=FUSED_OFFSETS, use_qk_l2norm=True)
    expected = ops.gated_delta_rule(**inputs, **options, implementation="reference")
    padded = np.arange(T) >= FUSED_CU[-1]
    poisoned = {name: jnp.asarray(np.where(padded.reshape(-1, *[1] * (x.ndim - 1)), np.nan, x).astype(x.dtype))
                for name, x in inputs.items()}  # NaN padding: nothing may read it unmasked
    return poisoned, options, expected


@pytest.mark.interpret
@pytest.mark.parametrize("pieces", [1, 3])
def test_public_entry_state_fused_in_the_interpreter(fused_case, pieces):
    # the fused kernels (`gdn_kkt`, `gdn_fused_lanes`, map mode for P > 1) in Mosaic GPU's interpreter through the
    # public entry, against float64
    inputs, options, expected = fused_case
    got = ops.gated_delta_rule(**inputs, **options,
                               config=ops.DeltaPallasMosaicGpuConfig(state="fused", pieces=pieces, interpret=True))
    num_ckpt = FUSED_CKPT_CU[-1]
    for name, a, r in zip(("o", "final", "ckpt"), got, expected):
        a = np.asarray(a, np.float32)
        assert a.shape == r.shape and np.isfinite(a).all(), name
        assert rel_rms(a, r) < 6e-3, (name, pieces, rel_rms(a, r))  # the bf16 class
    o, final, ckpt = (np.asarray(x, np.float32) for x in got)
    assert not o[FUSED_CU[-1]:].any() and not ckpt[num_ckpt:].any()  # padding tokens and entries zero
    # the empty row keeps its initial state through the maps' identity; each checkpoint on its own, the piece
    # boundaries (the scan's start states) included
    np.testing.assert_allclose(final[1], options["initial_state"][1], rtol=0, atol=1e-6)
    for m in range(num_ckpt):
        assert rel_rms(ckpt[m], expected[2][m]) < 6e-3, (m, FUSED_OFFSETS[m], rel_rms(ckpt[m], expected[2][m]))


def test_fused_split_lowers_for_sm90():
    # `gdn_kkt` and both fused passes (map and main, checkpoints included) lower for sm_90 at a real shape,
    # (1, 8192, 16) K = V = 128, without a GPU; the Triton cumsum launch is left out (its lowering needs a GPU)
    from jax import export

    from jaxckpt.plan.layout import chunk_layout

    T, H, D = 8192, 16, 128
    NC = T // CHUNK + 1
    arg = jax.ShapeDtypeStruct
    bf = jnp.bfloat16

    def fn(cu, ccu, offsets, q, k, v, beta, G, init):
        lay = chunk_layout(cu, ccu, offsets, chunk_size=CHUNK, num_tokens=T, xp=jnp)
        p = cumsum.Prepared(q, k, v, beta, G, lay, cu, ccu, 0.1, bf)
        return split.fused_pass_split(p, init, pieces=4)

    args = (arg((2,), jnp.int32), arg((2,), jnp.int32), arg((3,), jnp.int32), arg((T, H, D), bf), arg((T, H, D), bf),
            arg((T, H, D), bf), arg((T, H), jnp.float32), arg((H, NC, CHUNK), jnp.float32),
            arg((1, H, D, D), jnp.float32))
    module = export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    assert "gdn_kkt_mosaic_gpu" in module and "gdn_fused_lanes_map" in module
    assert "gdn_fused_lanes" in module.replace("gdn_fused_lanes_map", "")


def test_raw_q_k_never_reach_a_pass_that_reads_them_as_normalized():
    # `prepare(l2norm_in_kernel=True)` leaves q, k raw for the Mosaic GPU intra kernels; the passes that read p.q,
    # p.k as the op's (the fused GDN pass, the Triton intra launches) refuse such a `Prepared`
    from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import gdn_fused

    rng = np.random.default_rng(3)
    T, D = 70, 64
    q, k, v = (jnp.asarray(rng.normal(size=(T, 1, D)), jnp.bfloat16) for _ in range(3))
    g, beta = jnp.asarray(-rng.uniform(0, 0.1, size=(T, 1)), jnp.float32), jnp.full((T, 1), 0.5, jnp.float32)
    options = dict(per_channel_decay=False, scale=None, use_qk_l2norm=True, cu_seqlens=None, checkpoint_cu=None,
                   checkpoint_offsets=None, chunk_size=CHUNK, interpret=True)
    p = cumsum.prepare(q, k, v, g, beta, **options, l2norm_in_kernel=True)
    assert p.qk_l2norm and np.array_equal(np.asarray(p.k, np.float32), np.asarray(k, np.float32))
    for call in (lambda: triton_delta.intra_v2(p, per_channel_decay=False, chunk_size=CHUNK, interpret=True),
                 lambda: gdn_fused.gdn_fused_pass(p, None, interpret=True),
                 lambda: split.fused_pass_split(p, None, pieces=1, interpret=True)):
        with pytest.raises(ValueError, match="l2norm_in_kernel=False"):
            call()
    normalized = cumsum.prepare(q, k, v, g, beta, **options)
    assert not normalized.qk_l2norm
    np.testing.assert_array_equal(np.asarray(normalized.k), np.asarray(cumsum.l2norm(k)))
