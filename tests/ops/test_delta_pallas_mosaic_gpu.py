"""The Mosaic GPU state pass of GDN and KDA (`delta_rule.pallas_mosaic_gpu.pipeline`), run on CPU in Mosaic GPU's
interpreter (its cumsum and intra kernels in the Pallas HLO interpreter), against the float64 token-by-token references
and the Pallas Triton pipeline; checkpoints leave outputs and final states bitwise unchanged; NaN in padding tokens
leaks nowhere; the interpreter's race detector finds no unordered SMEM access; unsupported calls name their reason.

The interpreter's wgmma multiplies the 16-bit SMEM tiles in fp32, so the hi + lo products are exact here: these tests
check the algorithm, layouts, copies, masks and checkpoint positions, not the tensor-core rounding nor how the GPU's
TMA treats a tile copy at a row offset off the 8-row grid (the interpreter copies every row; the GPU tests in
tests/gpu/test_ops_mosaic_gpu.py check both). bf16 inputs are held to the shared vectors' bf16 class against float64
and to AGREE_TOL against the Triton pipeline (whose intra pass rounds w and u apart: fp32 dots, no 16-bit right-hand
sides).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxckpt.ops.common import api as common_api
from jaxckpt.ops.delta_rule import api as gdn_api
from jaxckpt.ops.delta_rule import pallas_triton as gdn_triton
from jaxckpt.ops.delta_rule import reference as gdn_reference
from jaxckpt.ops.delta_rule import reference as kda_reference
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import pipeline as gdn_mosaic
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import pipeline as kda_mosaic
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import pipeline as mosaic_delta
from tests.numerics import rel_rms
from tests.ops.intra_cases import raw_keys
from tests.ops.varlen_case import CU_SEQLENS, NUM_TOKENS

pytestmark = pytest.mark.interpret

BF16_TOL = 6e-3  # tests/vectors/loader.py's "bf16" class (rel-RMS)
AGREE_TOL = BF16_TOL  # two bf16-class pipelines with different intra rounding

# the shared varlen rows (K = V = 64: one V block) with their own checkpoints. Row 2: checkpoints at 1 and
# len - 1 in its only chunk; row 4: two in chunk 0 (1, 63), then at the chunk boundary 64 (chunk position 0: the
# carried state itself), 65 and len - 1 = 82 in chunk 1; then two padded CSR entries
CHECKPOINT_CU = np.array([0, 0, 0, 2, 2, 7], np.int32)
CHECKPOINT_OFFSETS = np.array([1, 35, 1, 63, 64, 65, 82, 0, 0], np.int32)
ROWS_WITH_STATE = (0, 2, 4)
HEAD_DIM = 64


def make_case(rng, *, per_channel, layout):
    """bf16 q, k, v (num_heads 1, num_v_heads 2), fp32 gates; initial states on some rows; the gate options."""
    T, HV, D = NUM_TOKENS, 2, HEAD_DIM
    g_shape = (T, HV, D) if per_channel else (T, HV)
    inputs = dict(q=rng.normal(size=(T, 1, D)), k=rng.normal(size=(T, 1, D)), v=rng.normal(size=(T, HV, D)),
                  g=-rng.exponential(0.3, size=g_shape) - np.where(rng.random(g_shape) < 0.05, 4.0, 0.0),
                  beta=rng.uniform(0.05, 0.95, size=(T, HV)))
    inputs = {name: x.astype(ml_dtypes.bfloat16 if name in "qkv" else np.float32) for name, x in inputs.items()}
    gate = {}
    if per_channel:  # Kimi-Linear's bounded gate on raw inputs
        inputs["g"] = (3.0 * rng.normal(size=g_shape)).astype(np.float32)
        gate = dict(A_log=rng.uniform(0.5, 1.5, size=HV).astype(np.float32),
                    dt_bias=rng.normal(size=(HV, D)).astype(np.float32), lower_bound=-5.0)
    num_rows = CU_SEQLENS.size - 1
    state = rng.normal(size=(num_rows, HV, D, D)).astype(np.float32)
    state[[n for n in range(num_rows) if n not in ROWS_WITH_STATE]] = 0.0
    options = dict(initial_state=state, cu_seqlens=CU_SEQLENS, checkpoint_cu=CHECKPOINT_CU,
                   checkpoint_offsets=CHECKPOINT_OFFSETS, state_layout=layout, use_qk_l2norm=True, **gate)
    return inputs, options


def poisoned(inputs):
    """The inputs with NaN in every padding token (past cu_seqlens[-1]): a kernel must never read them unmasked."""
    out = {}
    for name, x in inputs.items():
        x = np.array(x)
        x[CU_SEQLENS[-1]:] = np.nan
        out[name] = x
    return out


# hi + lo products on the state chain (the defaults, one term per product, `default_tuning`, are tested below)
HI_LO = dict(state_terms=2)


def run(op, inputs, options, interpret=True, **extra):
    if op in (gdn_mosaic.gated_delta_rule, kda_mosaic.kda):
        extra = {**HI_LO, **extra}
    arrays = {name: jnp.asarray(x) for name, x in inputs.items()}
    options = {name: jnp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in {**options, **extra}.items()}
    return [np.asarray(x.astype(jnp.float32)) for x in op(**arrays, **options, interpret=interpret)]


def check(actual, reference, triton):
    padding = slice(CU_SEQLENS[-1], None)
    num_real = CHECKPOINT_CU[-1]
    for name, a, r, t in zip(("o", "final_state", "checkpoint_states"), actual, reference, triton):
        assert a.shape == r.shape, name
        assert np.isfinite(a).all(), name
        assert rel_rms(a, r) <= BF16_TOL, (name, rel_rms(a, r))
        assert rel_rms(a, t) <= AGREE_TOL, (name, rel_rms(a, t))
    assert not actual[0][padding].any() and not actual[2][num_real:].any()


@pytest.fixture(scope="module")
def gdn_case():
    # with the interpreter's race detector: every SMEM / TMA / wgmma access ordered by barriers and fences
    inputs, options = make_case(np.random.default_rng(71), per_channel=False, layout="kv")
    outputs = run(gdn_mosaic.gated_delta_rule, poisoned(inputs), options,
                  interpret=plgpu.InterpretGPUParams(detect_races=True))
    return inputs, options, outputs, interpret_pallas_call.get_races().races_found


def test_gdn_matches_reference_and_triton(gdn_case):
    inputs, options, actual, races_found = gdn_case
    assert not races_found
    reference = gdn_reference.gated_delta_rule(**inputs, **options)
    triton = run(gdn_triton.gated_delta_rule, poisoned(inputs), options, fuse_output=True)
    check(actual, reference, triton)


def test_gdn_checkpoints_leave_outputs_bitwise_unchanged(gdn_case):
    inputs, options, with_checkpoints, _ = gdn_case
    plain = {name: x for name, x in options.items() if not name.startswith("checkpoint")}
    without = run(gdn_mosaic.gated_delta_rule, poisoned(inputs), plain)
    np.testing.assert_array_equal(with_checkpoints[0], without[0])
    np.testing.assert_array_equal(with_checkpoints[1], without[1])
    assert without[2].shape == (0, 2, HEAD_DIM, HEAD_DIM)


# KDA's "vk" call with its default intra inverse and with "split"; GDN's with "split" (its default inverse in "kv" runs
# in `gdn_case`)
@pytest.mark.parametrize("per_channel, intra_inverse", [(True, None), (True, "split"), (False, "split")],
                         ids=["kda-default", "kda-split", "gdn-split"])
def test_vk_layout_and_intra_inverse(per_channel, intra_inverse):
    # the "vk" state layout (KDA's gated rows included), and intra_inverse reaching the intra kernels ("split": hi +
    # lo products); bf16 class against float64, shapes and unwritten padding as `check`
    inputs, options = make_case(np.random.default_rng(79 + per_channel), per_channel=per_channel, layout="vk")
    options["initial_state"] = options["initial_state"].swapaxes(-1, -2).copy()
    mosaic, reference_op = ((kda_mosaic.kda, kda_reference.kda) if per_channel else
                            (gdn_mosaic.gated_delta_rule, gdn_reference.gated_delta_rule))
    tuning = {} if intra_inverse is None else dict(intra_inverse=intra_inverse)
    actual = run(mosaic, poisoned(inputs), options, **tuning)
    reference = reference_op(**inputs, **options)
    padding = slice(CU_SEQLENS[-1], None)
    for name, a, r in zip(("o", "final_state", "checkpoint_states"), actual, reference):
        assert a.shape == r.shape and np.isfinite(a).all(), name
        assert rel_rms(a, r) <= BF16_TOL, (name, rel_rms(a, r))
    assert not actual[0][padding].any() and not actual[2][CHECKPOINT_CU[-1]:].any()


@pytest.mark.parametrize("checkpoints", [True, False])
def test_gdn_rows_off_the_tile_grid(checkpoints):
    # the H200 failure's pattern at K = V = 64: rows of 100, 1 and 83 tokens (starts 0, 100, 101: off the 8-row TMA
    # tile grid; partial last chunks; a 1-token row in between), NaN padding, checkpoints (100: 1, 64, 99; 83: 64,
    # 82) or none, against the Triton pipeline and float64, token by token. The interpreter copies misaligned TMA
    # tiles whole, so it could not show the GPU dropping their rows (`delta_rule.pallas_mosaic_gpu.pipeline` docstring,
    # "TMA addresses"); it checks that O and the checkpoint keys reach every token of these rows
    rng = np.random.default_rng(89)
    T, D = 194, HEAD_DIM
    cu = np.array([0, 100, 101, 184], np.int32)
    inputs = dict(q=rng.normal(size=(T, 1, D)), k=rng.normal(size=(T, 1, D)), v=rng.normal(size=(T, 1, D)),
                  g=-rng.exponential(0.3, size=(T, 1)), beta=rng.uniform(0.05, 0.95, size=(T, 1)))
    inputs = {name: x.astype(ml_dtypes.bfloat16 if name in "qkv" else np.float32) for name, x in inputs.items()}
    options = dict(cu_seqlens=cu, use_qk_l2norm=True)
    if checkpoints:
        options.update(checkpoint_cu=np.array([0, 3, 3, 5], np.int32),
                       checkpoint_offsets=np.array([1, 64, 99, 64, 82], np.int32))
    nan_padded = {name: np.concatenate([x[:cu[-1]], np.full_like(x[cu[-1]:], np.nan)]) for name, x in inputs.items()}
    actual = run(gdn_mosaic.gated_delta_rule, nan_padded, options)
    triton = run(gdn_triton.gated_delta_rule, nan_padded, options, fuse_output=True)
    reference = gdn_reference.gated_delta_rule(**inputs, **options)
    names = ("o", "final_state", "checkpoint_states") if checkpoints else ("o", "final_state")
    for name, a, r, t in zip(names, actual, reference, triton):
        assert np.isfinite(a).all(), name
        assert rel_rms(a, r) <= BF16_TOL and rel_rms(a, t) <= AGREE_TOL, (name, rel_rms(a, r), rel_rms(a, t))
    # every token of every row, not only in the aggregate: a dropped row would be a few percent of the RMS
    token_error = np.abs(actual[0][:cu[-1]] - triton[0][:cu[-1]]).max(axis=(1, 2))
    bad = np.flatnonzero(token_error > 0.02 * np.abs(triton[0][:cu[-1]]).max())
    assert not bad.size, f"tokens {bad.tolist()} differ from the Triton pipeline (rows start at {cu[:-1].tolist()})"
    assert not actual[0][cu[-1]:].any()
    assert actual[2].shape == ((5, 1, D, D) if checkpoints else (0, 1, D, D))


def test_gdn_float16_two_value_blocks_one_row():
    # V = 128: two V blocks per value head (the second at columns 64..127); one row without an initial state whose
    # last chunk is partial, checkpoints in both chunks
    rng = np.random.default_rng(83)
    T, D, V = 100, HEAD_DIM, 128
    inputs = dict(q=rng.normal(size=(T, 1, D)), k=rng.normal(size=(T, 1, D)), v=rng.normal(size=(T, 1, V)),
                  g=-rng.exponential(0.3, size=(T, 1)), beta=rng.uniform(0.05, 0.95, size=(T, 1)))
    inputs = {name: x.astype(np.float16 if name in "qkv" else np.float32) for name, x in inputs.items()}
    options = dict(checkpoint_cu=np.array([0, 3], np.int32), checkpoint_offsets=np.array([5, 64, 99], np.int32),
                   use_qk_l2norm=True)
    actual = run(gdn_mosaic.gated_delta_rule, inputs, options)
    reference = gdn_reference.gated_delta_rule(**inputs, **options)
    triton = run(gdn_triton.gated_delta_rule, inputs, options, fuse_output=True)
    for name, a, r, t in zip(("o", "final_state", "checkpoint_states"), actual, reference, triton):
        assert rel_rms(a, r) <= BF16_TOL and rel_rms(a, t) <= AGREE_TOL, name


def test_supports_names_the_reason():
    rng = np.random.default_rng(79)
    inputs, _ = make_case(rng, per_channel=False, layout="kv")
    inputs = {name: jnp.asarray(x) for name, x in inputs.items()}
    assert gdn_mosaic.supports(**inputs, interpret=True) is None
    assert gdn_mosaic.supports(**inputs) is not None  # no Hopper GPU here
    assert "chunk_size" in gdn_mosaic.supports(**inputs, chunk_size=32, interpret=True)
    assert "unknown" in gdn_mosaic.supports(**inputs, interpret=True, block_v=64)
    assert "unknown" in gdn_mosaic.supports(**inputs, interpret=True, intra="pallas_triton")
    fp32 = {name: x.astype(jnp.float32) for name, x in inputs.items()}
    assert "16-bit" in gdn_mosaic.supports(**fp32, interpret=True)
    narrow = dict(inputs, v=jnp.zeros((NUM_TOKENS, 2, 32), jnp.bfloat16))
    assert gdn_mosaic.supports(**narrow, interpret=True).startswith("V:")
    assert gdn_mosaic.supports(**dict(inputs, g=inputs["g"][..., None]), interpret=True).startswith("g:")
    with pytest.raises(ValueError, match="^g:"):
        kda_mosaic.kda(**inputs, interpret=True)
    with pytest.raises(ValueError, match="16-bit"):
        gdn_mosaic.gated_delta_rule(**fp32, interpret=True)
    assert "kda_score_parts" in gdn_mosaic.supports(**inputs, interpret=True, kda_score_parts=2)
    # intra_inverse reaches the Mosaic GPU intra kernels' `inverse` (and is checked there)
    assert gdn_mosaic.supports(**inputs, interpret=True, intra_inverse="blocked") is None
    assert "inverse" in gdn_mosaic.supports(**inputs, interpret=True, intra_inverse="tf32")
    assert "intra_inverse" in gdn_mosaic.supports(**inputs, interpret=True, state="fused", intra_inverse="blocked")
    # first in the automatic order; off a Hopper GPU it declines with its reason and the order falls back
    call = dict(inputs, chunk_size=64)
    choice = common_api.choose_implementation(gdn_api.GDN_REGISTRY, None, **call)
    assert choice.declined[0][0] == "pallas_mosaic_gpu" and "sm_90" in choice.declined[0][1]
    assert choice.name != "pallas_mosaic_gpu"


def test_supports_sizes_the_launch_grids_from_the_rows():
    """The chunk layout has T // 64 + N chunks, the state passes N x pieces lanes, and CUDA caps the grid axes they
    land on (y, z) at 65535; cu_seqlens' static shape gives N. Only shapes are read: nothing is allocated."""
    def shapes(num_tokens):  # q = k = v [T, 1, 64] and g = beta [T, 1]
        x = jax.ShapeDtypeStruct((num_tokens, 1, 64), jnp.bfloat16)
        return x, jax.ShapeDtypeStruct((num_tokens, 1), jnp.float32)

    def call(num_tokens, num_rows=None, **tuning):
        x, gate = shapes(num_tokens)
        rows = {} if num_rows is None else {"cu_seqlens": jax.ShapeDtypeStruct((num_rows + 1,), jnp.int32)}
        return mosaic_delta.supports(x, x, x, gate, gate, interpret=True, **rows, **tuning)

    T = 64 * 65530
    assert call(T) is None and call(T, 5) is None  # 65531 and 65535 chunks
    assert "65536 chunks" in call(T, 6)  # the Mosaic GPU intra grid
    assert call(T, 6, state="fused").startswith("state pass (fused): G: 65536 chunks")  # `gdn_kkt`'s grid
    assert call(256, 2000, pieces=32) is None
    assert "128000 lanes" in call(256, 2000, pieces=64)
    assert "70000 lanes" in call(256, 70000, pieces=1)
    assert call(256, 0).startswith("cu_seqlens:")
    # the entry has the rows even where `supports` was asked without them
    entry = lambda x, gate, cu: mosaic_delta.delta_rule_mosaic(  # noqa: E731
        x, x, x, gate, gate, cu_seqlens=cu, per_channel_decay=False, state="v2", pieces=64, interpret=True)
    with pytest.raises(ValueError, match="128000 lanes"):
        jax.eval_shape(entry, *shapes(256), jax.ShapeDtypeStruct((2001,), jnp.int32))


def test_defaults_run_the_lanes_pass_against_float64(gdn_case):
    """Left-out options: the lanes state pass with pieces from the shapes and one 16-bit term per product on the state
    chain (FLA's precision); the Mosaic GPU intra for any keys. In the bf16 class against float64, and really another
    rounding than `gdn_case`'s hi + lo products on the same inputs."""
    assert mosaic_delta.default_tuning(per_channel_decay=False) == dict(state="v2", pieces="auto",
                                                                        state_terms=1)
    assert mosaic_delta.default_tuning(per_channel_decay=True) == dict(state="v2", pieces="auto",
                                                                       state_terms=1)
    inputs, options, hi_lo, _ = gdn_case
    arrays = {name: jnp.asarray(x) for name, x in poisoned(inputs).items()}
    given = {name: jnp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in options.items()}
    actual = [np.asarray(x, np.float32) for x in gdn_mosaic.gated_delta_rule(**arrays, **given, interpret=True)]
    reference = gdn_reference.gated_delta_rule(**inputs, **options)
    for name, a, r in zip(("o", "final_state", "checkpoint_states"), actual, reference):
        assert np.isfinite(a).all() and rel_rms(a, r) <= BF16_TOL, (name, rel_rms(a, r))
    # the lo halves' share (measured on the fused pass: 6.6e-4 of o, 2.4e-4 of the checkpoints; fp32 reordering ~1e-7)
    assert rel_rms(actual[0], hi_lo[0]) > 1e-4 and rel_rms(actual[2], hi_lo[2]) > 1e-5
    with pytest.raises(ValueError, match="state='fused' replaces"):
        mosaic_delta.delta_rule_mosaic(**arrays, per_channel_decay=False, interpret=True, state="fused",
                                       intra_inverse="blocked")


@pytest.mark.parametrize("per_channel", [False, True])
def test_defaults_on_raw_keys_against_float64(per_channel):
    """The default call with use_qk_l2norm=False on raw near-parallel keys (`intra_cases.raw_keys`: norms over
    [1e-3, 1e3], beta = beta' / |k|^2 with beta' up to 2): the Mosaic GPU intra's scaled inverse keeps the whole op in
    the bf16 class."""
    rng = np.random.default_rng()
    inputs, options = make_case(rng, per_channel=per_channel, layout="kv")
    raw = raw_keys(rng, {"k": inputs["k"].astype(np.float32), "beta": inputs["beta"]}, norms=(1e-3, 1e3))
    inputs["k"], inputs["beta"] = raw["k"].astype(ml_dtypes.bfloat16), raw["beta"]
    options["use_qk_l2norm"] = False
    arrays = {name: jnp.asarray(x) for name, x in poisoned(inputs).items()}
    given = {name: jnp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in options.items()}
    mosaic, reference = (kda_mosaic.kda, kda_reference.kda) if per_channel else (
        gdn_mosaic.gated_delta_rule, gdn_reference.gated_delta_rule)
    actual = [np.asarray(x, np.float32) for x in mosaic(**arrays, **given, interpret=True)]
    for name, a, r in zip(("o", "final_state", "checkpoint_states"), actual, reference(**inputs, **options)):
        assert np.isfinite(a).all() and rel_rms(a, r) <= BF16_TOL, (name, rel_rms(a, r))


def test_fused_pass_one_state_term_against_float64():
    """The fused GDN pass with state_terms=1 (one 16-bit term per product on the state chain): in the bf16 class
    against float64, with the rows split into pieces, and really another rounding than its hi + lo products (the
    lanes pass's is `test_defaults_run_the_lanes_pass_against_float64`)."""
    inputs, options = make_case(np.random.default_rng(), per_channel=False, layout="kv")
    arrays = {name: jnp.asarray(x) for name, x in poisoned(inputs).items()}
    given = {name: jnp.asarray(x) if isinstance(x, np.ndarray) else x for name, x in options.items()}
    call = lambda terms: [np.asarray(x, np.float32) for x in gdn_mosaic.gated_delta_rule(  # noqa: E731
        **arrays, **given, interpret=True, state="fused", pieces=2, state_terms=terms)]
    one, two = call(1), call(2)
    reference = gdn_reference.gated_delta_rule(**inputs, **options)
    for name, a, r in zip(("o", "final_state", "checkpoint_states"), one, reference):
        assert np.isfinite(a).all() and rel_rms(a, r) <= BF16_TOL, (name, rel_rms(a, r))
    assert not one[0][CU_SEQLENS[-1]:].any()
    # the lo halves' share: ~6e-4 of o and ~1e-4 of the checkpoints on this case (fp32 reordering: ~1e-7)
    assert rel_rms(one[0], two[0]) > 1e-4 and rel_rms(one[2], two[2]) > 1e-5


def test_state_terms_is_checked():
    inputs, _ = make_case(np.random.default_rng(83), per_channel=False, layout="kv")
    inputs = {name: jnp.asarray(x) for name, x in inputs.items()}
    assert gdn_mosaic.supports(**inputs, interpret=True, state_terms=1) is None
    assert "state_terms must be 1 or 2" in gdn_mosaic.supports(**inputs, interpret=True, state_terms=3)
    with pytest.raises(ValueError, match="state_terms must be 1 or 2"):
        mosaic_delta.delta_rule_mosaic(**inputs, per_channel_decay=False, interpret=True, state_terms=True)


# each state kernel once (the lanes pass for GDN and KDA, the fused GDN pass), pieces 1 and 2 both seen
@pytest.mark.parametrize("op, state, pieces", [("gdn", "v2", 1), ("gdn", "fused", 2), ("kda", "v2", 2)])
def test_token_layout_output_against_float64(op, state, pieces):
    """The lanes kernels store O straight into the token layout: rows of 1, 37, 83 and 0 tokens (chunk starts 0, 1,
    38, 102: off the 8-row grid; every row's last chunk partial, stored as boxes of 32, ..., 1 rows), then 75 padding
    tokens (one whole 64-row zero box and 11 rows) holding NaN in every input. Token by token against float64, the
    padding tokens exactly zero; with pieces = 2 the 37-token row has an empty piece and the 83-token row one chunk
    per piece, each lane storing only its own chunks."""
    rng = np.random.default_rng(97 + pieces)
    cu = np.array([0, 1, 38, 121, 121], np.int32)
    T, HV, D = 196, 2, HEAD_DIM
    g_shape = (T, HV, D) if op == "kda" else (T, HV)
    inputs = dict(q=rng.normal(size=(T, 1, D)), k=rng.normal(size=(T, 1, D)), v=rng.normal(size=(T, HV, D)),
                  g=-rng.exponential(0.1, size=g_shape), beta=rng.uniform(0.05, 0.95, size=(T, HV)))
    inputs = {name: x.astype(ml_dtypes.bfloat16 if name in "qkv" else np.float32) for name, x in inputs.items()}
    state_0 = rng.normal(size=(cu.size - 1, HV, D, D)).astype(np.float32)
    options = dict(initial_state=state_0, cu_seqlens=cu, checkpoint_cu=np.array([0, 0, 1, 2, 2], np.int32),
                   checkpoint_offsets=np.array([36, 70], np.int32), use_qk_l2norm=True)
    nan_padded = {name: np.concatenate([x[:cu[-1]], np.full_like(x[cu[-1]:], np.nan)]) for name, x in inputs.items()}
    mosaic, reference_op = ((kda_mosaic.kda, kda_reference.kda) if op == "kda" else
                            (gdn_mosaic.gated_delta_rule, gdn_reference.gated_delta_rule))
    tuning = dict(state=state, pieces=pieces)
    actual = run(mosaic, nan_padded, options, **tuning)
    reference = reference_op(**inputs, **options)
    for name, a, r in zip(("o", "final_state", "checkpoint_states"), actual, reference):
        assert a.shape == r.shape and np.isfinite(a).all(), name
        assert rel_rms(a, r) <= BF16_TOL, (name, rel_rms(a, r))
    o, o_ref = actual[0][:cu[-1]], np.asarray(reference[0], np.float32)[:cu[-1]]
    token_error = np.abs(o - o_ref).max(axis=(1, 2))
    bad = np.flatnonzero(token_error > 0.05 * np.abs(o_ref).max())
    assert not bad.size, f"tokens {bad.tolist()} differ from float64 (rows start at {cu[:-1].tolist()})"
    np.testing.assert_array_equal(actual[0][cu[-1]:], 0)
