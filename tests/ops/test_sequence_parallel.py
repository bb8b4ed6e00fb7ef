"""Sequence-parallel GDN and KDA (`implementation="sequence_parallel"`): long rows cut into pieces joined by their
affine state maps, over the XLA chunked base and the Pallas Triton base (interpret mode on CPU).

Against the float64 references: outputs, final states and checkpoints, varlen rows (empty, 1-token, checkpoint-free),
initial states, both state layouts; piece boundaries at and off checkpoints give the same checkpoints; the shared
vectors in their own tolerance classes (fp32 cases: the fp32 class, 1e-5; bf16 cases: the bf16 class, 6e-3).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxckpt import ops
from jaxckpt.ops.delta_rule import reference, xla
from jaxckpt.ops.delta_rule import sequence_parallel as sp
from tests.numerics import rel_rms
from tests.vectors.loader import check_case, load_cases

H, HV = 2, 4
FP32_TOL = 1e-5
BF16_TOL = 6e-3
CHUNK = 16

# rows of 0, 1, 36, 0, 163 and 90 tokens, then 10 padding tokens; row 2 has checkpoints off the chunk grid (1, 16 is
# on it, 35), row 4 on (32, 64) and off it (150), row 5 none; two padded CSR entries
CU_SEQLENS = np.array([0, 0, 1, 37, 37, 200, 290], np.int32)
NUM_TOKENS = 300
CHECKPOINT_CU = np.array([0, 0, 0, 3, 3, 6, 6], np.int32)
CHECKPOINT_OFFSETS = np.array([1, 16, 35, 32, 64, 150, 0, 0], np.int32)
NUM_ROWS = CU_SEQLENS.size - 1
ROWS_WITH_STATE = (0, 2, 4)


def make_inputs(rng, head_k, head_v, *, per_channel, dtype=np.float32):
    g_shape = (NUM_TOKENS, HV, head_k) if per_channel else (NUM_TOKENS, HV)
    g = -rng.exponential(0.3, size=g_shape) - np.where(rng.random(g_shape) < 0.05, 4.0, 0.0)
    return dict(q=rng.normal(size=(NUM_TOKENS, H, head_k)).astype(dtype),
                k=rng.normal(size=(NUM_TOKENS, H, head_k)).astype(dtype),
                v=rng.normal(size=(NUM_TOKENS, HV, head_v)).astype(dtype),
                g=g.astype(np.float32),
                beta=rng.uniform(0.05, 0.95, size=(NUM_TOKENS, HV)).astype(np.float32))


def make_initial_state(rng, head_k, head_v, layout):
    shape = (NUM_ROWS, HV, head_k, head_v) if layout == "kv" else (NUM_ROWS, HV, head_v, head_k)
    state = rng.normal(size=shape).astype(np.float32)
    state[[n for n in range(NUM_ROWS) if n not in ROWS_WITH_STATE]] = 0.0
    return state


def varlen(initial_state, layout, **options):
    return dict(initial_state=initial_state, cu_seqlens=CU_SEQLENS, checkpoint_cu=CHECKPOINT_CU,
                checkpoint_offsets=CHECKPOINT_OFFSETS, state_layout=layout, use_qk_l2norm=True, **options)


def assert_matches(actual, expected, tol):
    for name, a, e in zip(("o", "final_state", "checkpoint_states"), actual, expected):
        assert a.shape == e.shape, name
        a = np.asarray(a)
        assert not np.isnan(a).any(), name
        assert rel_rms(a, e) <= tol, (name, rel_rms(a, e))
    valid = int(CHECKPOINT_CU[-1])
    for m in range(valid):  # every checkpoint on its own, as the shared vectors do
        assert rel_rms(actual[2][m], expected[2][m]) <= tol, (m, rel_rms(actual[2][m], expected[2][m]))
    assert np.all(np.asarray(actual[2])[valid:] == 0)
    assert np.all(np.asarray(actual[0])[CU_SEQLENS[-1]:] == 0)


def base_options(base):
    return dict(base=base, interpret=True) if base == "pallas_triton" else dict(base=base)


# ---------------------------------------------------------------------------------------------------------------
# piece planning


def plan(piece_len, piece_cuts, cu=CU_SEQLENS, ccu=CHECKPOINT_CU, offsets=CHECKPOINT_OFFSETS, num_tokens=NUM_TOKENS):
    p = sp.plan_pieces(cu, ccu, offsets, num_tokens=num_tokens, piece_len=piece_len, chunk_size=CHUNK,
                       piece_cuts=piece_cuts)
    return p._replace(**{f: None if getattr(p, f) is None else np.asarray(getattr(p, f)) for f in p._fields})


@pytest.mark.parametrize("piece_cuts", sp.PIECE_CUTS)
def test_plan_partitions_rows_into_pieces(piece_cuts):
    p = plan(48, piece_cuts)
    assert p.row.size == sp.num_pieces(NUM_TOKENS, NUM_ROWS, CHECKPOINT_OFFSETS.size, 48, piece_cuts)
    starts, ends = p.cu[:-1], p.cu[1:]
    assert p.cu[0] == 0 and p.cu[-1] == CU_SEQLENS[-1] and np.all(ends >= starts)
    for n in range(NUM_ROWS):
        mine = np.nonzero(p.row == n)[0]
        mine = mine[mine <= p.row_last[n]]
        # a row's pieces are contiguous, start with its first piece and tile exactly its tokens
        assert p.first[mine[0]] and not p.first[mine[1:]].any()
        assert starts[mine[0]] == CU_SEQLENS[n] and ends[p.row_last[n]] == CU_SEQLENS[n + 1]
        assert np.all(starts[mine[1:]] == ends[mine[:-1]])
        lengths = ends[mine] - starts[mine]
        assert lengths.max() <= 2 * 48
        rel = (starts[mine] - CU_SEQLENS[n])[lengths > 0]  # empty pieces (duplicate cuts, unused entries) aside
        ckpts = CU_SEQLENS[n] + CHECKPOINT_OFFSETS[CHECKPOINT_CU[n]:CHECKPOINT_CU[n + 1]]
        if piece_cuts == "checkpoints":
            assert set(ckpts) <= set(starts[mine])  # every checkpoint is a piece boundary
            off_grid = set((ckpts - CU_SEQLENS[n])[(ckpts - CU_SEQLENS[n]) % CHUNK != 0])
            assert all(r % CHUNK == 0 or r in off_grid for r in rel)
        else:
            assert np.all(rel % CHUNK == 0)  # pieces keep the row's chunk grid
    assert p.first.sum() == NUM_ROWS


def test_plan_snaps_grid_cuts_to_checkpoints():
    # row 4 (163 tokens, pieces of 48): grid cuts at 48, 96, 144; aligned checkpoints 32 and 64 both bid for 48,
    # 32 wins the tie (earlier); 150 is off the chunk grid and never a snap target
    grid, snap, cuts = plan(48, "grid"), plan(48, "snap"), plan(48, "checkpoints")
    row4 = lambda p: sorted(set(p.cu[:-1][(p.row == 4)]) - {CU_SEQLENS[4]})  # noqa: E731
    assert [c - 37 for c in row4(grid)] == [48, 96, 144]
    assert [c - 37 for c in row4(snap)] == [32, 96, 144]
    assert [c - 37 for c in row4(cuts)] == [32, 64, 96, 144, 150]
    # where the checkpoint lies: grid exports 32 inside a piece, snap takes it from the scan
    m = 3
    assert not grid.boundary[m] and snap.boundary[m] and cuts.boundary[m]
    assert cuts.kernel_cu is None and grid.kernel_cu[-1] == 6 and snap.kernel_cu[-1] == 5


def test_plan_works_with_traced_metadata():
    expected = plan(48, "snap")
    traced = jax.jit(lambda cu, ccu, off: sp.plan_pieces(cu, ccu, off, num_tokens=NUM_TOKENS, piece_len=48,
                                                         chunk_size=CHUNK, piece_cuts="snap"))(
        jnp.asarray(CU_SEQLENS), jnp.asarray(CHECKPOINT_CU), jnp.asarray(CHECKPOINT_OFFSETS))
    for name, a, b in zip(expected._fields, expected, traced):
        np.testing.assert_array_equal(a, np.asarray(b), err_msg=name)


def test_choose_piece_len_from_the_batch_shape():
    shape = dict(head_k=128, head_v=128, chunk_size=64)
    assert sp.choose_piece_len(num_tokens=32768, num_rows=1, num_v_heads=16, **shape) == (2048, None)
    assert sp.choose_piece_len(num_tokens=131072, num_rows=1, num_v_heads=16, **shape) == (8192, None)
    length, reason = sp.choose_piece_len(num_tokens=32768, num_rows=8, num_v_heads=32, **shape)
    assert length is None and reason.startswith("batch: ")
    length, reason = sp.choose_piece_len(num_tokens=900, num_rows=1, num_v_heads=16, **shape)
    assert length is None and reason.startswith("tokens: ")
    assert sp.choose_piece_len(num_tokens=300, num_rows=6, num_v_heads=4, head_k=16, head_v=32, chunk_size=16,
                               piece_len=40) == (48, None)


# ---------------------------------------------------------------------------------------------------------------
# against the references


@pytest.mark.parametrize("base, piece_cuts, layout, compose, correction", [
    ("xla", "checkpoints", "kv", "associative", None),
    ("xla", "grid", "vk", "sequential", None),
    pytest.param("pallas_triton", "checkpoints", "vk", "associative", None, marks=pytest.mark.interpret),
    pytest.param("pallas_triton", "snap", "kv", "associative", "xla", marks=pytest.mark.interpret),
])
def test_gdn_matches_reference(base, piece_cuts, layout, compose, correction):
    rng = np.random.default_rng(11)
    inputs = make_inputs(rng, 16, 32, per_channel=False)  # K + V = 48: the Pallas base widens to 64
    init = make_initial_state(rng, 16, 32, layout)
    kwargs = varlen(init, layout)
    options = dict(piece_len=48, piece_cuts=piece_cuts, compose=compose, correction=correction, **base_options(base))
    choice, _ = sp.resolve(*(jnp.asarray(x) for x in inputs.values()), chunk_size=CHUNK, options=options)
    # the Pallas base takes the Pallas output correction unless told otherwise
    assert choice["correction"] == (correction or ("pallas" if base == "pallas_triton" else "xla"))
    out = sp.gated_delta_rule(**inputs, **kwargs, chunk_size=CHUNK, **options)
    assert out[0].dtype == jnp.float32 and out[1].dtype == out[2].dtype == jnp.float32
    assert_matches(out, reference.gated_delta_rule(**inputs, **kwargs), FP32_TOL)


@pytest.mark.parametrize("base, piece_cuts, gate", [
    ("xla", "snap", "log_decay"),
    pytest.param("pallas_triton", "grid", "a_log", marks=pytest.mark.interpret),
])
def test_kda_matches_reference(base, piece_cuts, gate):
    rng = np.random.default_rng(22)
    inputs = make_inputs(rng, 32, 16, per_channel=True)
    gate_kwargs = {}
    if gate == "a_log":
        inputs["g"] = rng.normal(size=inputs["g"].shape).astype(np.float32)
        gate_kwargs = dict(A_log=rng.uniform(-1.0, 1.0, HV).astype(np.float32),
                           dt_bias=rng.normal(size=HV * 32).astype(np.float32))
    init = make_initial_state(rng, 32, 16, "kv")
    kwargs = varlen(init, "kv", **gate_kwargs)
    out = sp.kda(**inputs, **kwargs, chunk_size=CHUNK, piece_len=64, piece_cuts=piece_cuts, **base_options(base))
    assert_matches(out, reference.kda(**inputs, **kwargs), FP32_TOL)


@pytest.mark.parametrize("per_channel, base", [
    (False, "xla"), pytest.param(True, "pallas_triton", marks=pytest.mark.interpret)])
def test_piece_boundaries_at_and_off_checkpoints_give_the_same_checkpoints(per_channel, base):
    """"checkpoints" puts every checkpoint on a piece boundary (its state comes out of the map composition), "grid"
    leaves them inside pieces unless the grid hits them (exported by the base kernel and finished with P_r S_in + U_r),
    "snap" moves a grid cut onto one. All agree with each other and the reference."""
    rng = np.random.default_rng(33 + per_channel)
    inputs = make_inputs(rng, 16, 16, per_channel=per_channel)
    init = make_initial_state(rng, 16, 16, "kv")
    kwargs = varlen(init, "kv")
    op, ref = (sp.kda, reference.kda) if per_channel else (sp.gated_delta_rule,
                                                                    reference.gated_delta_rule)
    expected = ref(**inputs, **kwargs)
    runs = {}
    for piece_len, piece_cuts in ((32, "checkpoints"), (32, "grid"), (48, "snap")):
        plan_ = plan(piece_len, piece_cuts)
        on_boundary = plan_.boundary[:CHECKPOINT_CU[-1]]
        runs[piece_len, piece_cuts] = out = op(**inputs, **kwargs, chunk_size=CHUNK, piece_len=piece_len,
                                               piece_cuts=piece_cuts, **base_options(base))
        assert_matches(out, expected, FP32_TOL)
        if piece_cuts == "checkpoints":
            assert on_boundary.all()
        elif piece_cuts == "grid":
            assert on_boundary.tolist() == [False, False, False, True, True, False]  # 32 and 64 lie on the grid
        else:
            assert on_boundary.tolist() == [False, False, False, True, False, False]  # 32 takes the cut at 48
    reference_run = runs[32, "checkpoints"]
    for key, out in runs.items():
        for m in range(CHECKPOINT_CU[-1]):
            assert rel_rms(out[2][m], reference_run[2][m]) <= 1e-6, (key, m)


@pytest.mark.parametrize("per_channel, base", [
    (False, "xla"), pytest.param(True, "pallas_triton", marks=pytest.mark.interpret)])
def test_bfloat16_inputs_land_in_the_bf16_class(per_channel, base):
    rng = np.random.default_rng(44 + per_channel)
    inputs = make_inputs(rng, 16, 16, per_channel=per_channel, dtype=ml_dtypes.bfloat16)
    init = make_initial_state(rng, 16, 16, "kv")
    kwargs = varlen(init, "kv")
    op, ref = (sp.kda, reference.kda) if per_channel else (sp.gated_delta_rule,
                                                                    reference.gated_delta_rule)
    out = op(**{name: jnp.asarray(x) for name, x in inputs.items()}, **kwargs, chunk_size=CHUNK, piece_len=32,
             **base_options(base))
    assert out[0].dtype == jnp.bfloat16 and out[1].dtype == out[2].dtype == jnp.float32
    assert_matches(out, ref(**inputs, **kwargs), BF16_TOL)


def test_one_long_row_with_an_initial_state_and_one_checkpoint():
    """The issue's shape in miniature: one row, an initial state, one checkpoint on a boundary, many pieces."""
    rng = np.random.default_rng(55)
    length = 288
    inputs = {name: x[:length] for name, x in make_inputs(rng, 16, 16, per_channel=False).items()}
    init = rng.normal(size=(1, HV, 16, 16)).astype(np.float32)
    kwargs = dict(initial_state=init, checkpoint_cu=np.array([0, 1], np.int32),
                  checkpoint_offsets=np.array([256], np.int32), use_qk_l2norm=True)
    out = sp.gated_delta_rule(**inputs, **kwargs, chunk_size=CHUNK, piece_len=32, base="xla")
    expected = reference.gated_delta_rule(**inputs, **kwargs)
    for a, e in zip(out, expected):
        assert rel_rms(a, e) <= FP32_TOL


def test_falls_back_to_the_plain_base_where_pieces_do_not_pay():
    rng = np.random.default_rng(66)
    inputs = make_inputs(rng, 16, 16, per_channel=False)
    init = make_initial_state(rng, 16, 16, "kv")
    kwargs = dict(initial_state=init, cu_seqlens=CU_SEQLENS, checkpoint_cu=CHECKPOINT_CU,
                  checkpoint_offsets=CHECKPOINT_OFFSETS, use_qk_l2norm=True, chunk_size=CHUNK)
    # one piece would hold every token, and the default heuristic at this tiny shape: the plain XLA call, bitwise
    plain = xla.gated_delta_rule(**inputs, **kwargs)
    for options in (dict(piece_len=NUM_TOKENS), {}):
        out = sp.gated_delta_rule(**inputs, **kwargs, base="xla", **options)
        for a, b in zip(out, plain):
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# through the public entries


def test_public_entry_with_decode_rows_and_split():
    rng = np.random.default_rng(77)
    cu = np.array([0, 1, 2, 90, 200], np.int32)  # two decode rows first
    ccu = np.array([0, 0, 0, 2, 3], np.int32)
    offsets = np.array([32, 50, 64, 0], np.int32)
    T = int(cu[-1])
    inputs = {name: x[:T] for name, x in make_inputs(rng, 16, 16, per_channel=False).items()}
    init = rng.normal(size=(4, HV, 16, 16)).astype(np.float32)
    call = dict(initial_state=init, cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets,
                use_qk_l2norm=True, chunk_size=CHUNK)
    expected = ops.gated_delta_rule(*inputs.values(), **call, implementation="reference")
    config = ops.SequenceParallelConfig(base="xla", piece_len=32)
    for method in ("in_chunk", "split"):
        got = ops.gated_delta_rule(*inputs.values(), **call, num_decodes=2, checkpoint_method=method, config=config)
        for a, b in zip(got[:2], expected[:2]):
            assert rel_rms(a, b) <= FP32_TOL, method
        assert rel_rms(got[2][:3], expected[2][:3]) <= FP32_TOL, method


def test_public_entry_with_batched_inputs():
    rng = np.random.default_rng(78)
    inputs = make_inputs(rng, 16, 16, per_channel=True)
    batched = [x[:192].reshape(2, 96, *x.shape[1:]) for x in inputs.values()]  # B rows of equal length
    got = ops.kda(*batched, config=ops.SequenceParallelConfig(base="xla", piece_len=32), chunk_size=CHUNK)
    want = ops.kda(*batched, implementation="reference")
    assert got[0].shape == (2, 96, HV, 16)
    for a, b in zip(got[:2], want[:2]):
        assert rel_rms(np.asarray(a).reshape(np.shape(b)), b) <= FP32_TOL


def test_traced_metadata_compiles_once():
    rng = np.random.default_rng(88)
    inputs = {name: x[:96] for name, x in make_inputs(rng, 16, 16, per_channel=False).items()}
    traces = []

    @jax.jit
    def run(cu, ccu, offsets):
        traces.append(None)
        return ops.gated_delta_rule(*inputs.values(), cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets,
                                    use_qk_l2norm=True, chunk_size=CHUNK,
                                    config=ops.SequenceParallelConfig(base="xla", piece_len=32))

    for cu, ccu, offsets in [([0, 40, 41, 90], [0, 2, 2, 3], [1, 32, 17, 0]),
                             ([0, 0, 70, 96], [0, 0, 3, 4], [16, 32, 69, 5])]:
        cu, ccu, offsets = (np.asarray(x, np.int32) for x in (cu, ccu, offsets))
        got = run(cu, ccu, offsets)
        expected = reference.gated_delta_rule(**inputs, cu_seqlens=cu, checkpoint_cu=ccu,
                                                  checkpoint_offsets=offsets, use_qk_l2norm=True)
        for a, b in zip(got, expected):
            assert rel_rms(a, b) <= FP32_TOL
    assert len(traces) == 1


def test_unsupported_calls_name_their_reason():
    rng = np.random.default_rng(99)
    inputs = {name: jnp.asarray(x[:64]) for name, x in make_inputs(rng, 16, 16, per_channel=False).items()}
    for options, message in [(dict(piece_cuts="every"), "piece_cuts: "), (dict(compose="tree"), "compose: "),
                             (dict(base="cuda"), "base: "), (dict(piece_len=0), "piece_len: "),
                             (dict(base="xla", num_warps=4), "tuning: "),
                             (dict(base="pallas_triton"), "base: ")]:  # no GPU and no interpret=True here
        assert sp.supports(*inputs.values(), **options).startswith(message)
    with pytest.raises(ValueError, match="implementation: 'sequence_parallel' does not support this call: base: "):
        ops.gated_delta_rule(*inputs.values(), config=ops.SequenceParallelConfig(base="pallas_triton"))
    assert sp.supports(*inputs.values()) is None  # the XLA base, here on CPU
    assert sp.supports(*dict(inputs, g=inputs["g"][..., None]).values()).startswith("g: ")
    with pytest.raises(ValueError, match="^g: "):
        sp.kda(*inputs.values())


# ---------------------------------------------------------------------------------------------------------------
# the shared vectors, each case in its own class

# each case compiles on its own (about 10 s on 2 cores, more in interpret mode): the hardest fp32 and bf16 cases of
# each op here (all 22 pass with both bases)
HARD_CASES = ("chunk_edges", "bf16_long_weak_decay", "tiny_rows_fused_gate", "bf16_lower_bound_vk")
DELTA_CASES = [(op, case) for op in ("gdn", "kda") for case in load_cases(op) if case.name in HARD_CASES]
ENTRIES = {"gdn": ops.gated_delta_rule, "kda": ops.kda}


@pytest.mark.parametrize("op, case", DELTA_CASES, ids=[f"{op}-{case.name}" for op, case in DELTA_CASES])
def test_xla_base_matches_vectors(op, case):
    config = ops.SequenceParallelConfig(base="xla", piece_len=128, piece_cuts="checkpoints")
    outputs = ENTRIES[op](**case.arguments, config=config)
    check_case(case, [np.asarray(o) for o in outputs])


@pytest.mark.interpret
@pytest.mark.parametrize("op, case", DELTA_CASES, ids=[f"{op}-{case.name}" for op, case in DELTA_CASES])
def test_pallas_base_matches_vectors(op, case):
    config = ops.SequenceParallelConfig(base="pallas_triton", interpret=True, piece_len=64, piece_cuts="snap")
    outputs = ENTRIES[op](**case.arguments, config=config)
    check_case(case, [np.asarray(o) for o in outputs])
