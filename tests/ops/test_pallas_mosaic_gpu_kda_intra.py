"""The Mosaic GPU KDA intra-chunk kernel (`delta_rule.pallas_mosaic_gpu.kda_intra.kda_intra`) under Mosaic GPU's CPU
interpreter, against the Triton KDA intra launches (`intra_v2(prepare(...), per_channel_decay=True)`, interpret mode)
and an independent float64 numpy computation of the definitions, output by output; fresh random inputs each run (the
seed is in every failure message).

Rows of lengths 0, 1, 36, 0, 83 then 10 padding tokens holding NaN: chunks start at unaligned tokens, the last one
is partial and its TMA window runs past T (zero-filled), and the NaNs check that nothing past a chunk's length
leaks into its outputs. The strong-decay case drives G below -88 inside a chunk, where a naive exp(G_i) exp(-G_j)
factorisation overflows fp32. The interpreter computes 16-bit wgmmas exactly in fp32, as the tensor cores do. The
cases cover the inverses ("f16", "split", "blocked"), both score precisions and the three I/O dtypes.

The tuning cases run with the interpreter's race detector (the cases whose property is numerical, raw keys' norms,
strong decays, the score operands' rounding, run the SMEM schedule of a tuning case and skip it: it costs a third of an
interpreted run). It tracks TMA copies and RefUnion alias groups but not wgmma operand reads (no vector clocks on wgmma
in jax 0.11.2), so a missing `commit_smem` before a wgmma is not caught here; `test_lowers_for_sm90` checks what only
the real lowering checks (SMEM size, layouts, TMA shapes).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# no public accessor in jax 0.11.2 for the race detector's verdict or for resetting after a failed kernel
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races, reset_gpu_interpret_mode_state
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxckpt.ops.delta_rule import cumsum, reference
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import kda_intra as mki
from tests.numerics import rel_rms
from tests.ops.intra_cases import OUTPUTS, mosaic_kda_intra, prepared, raw_keys, raw_rows, triton_kda_intra
from tests.ops.intra_cases import make_kda_inputs as make_inputs

pytestmark = pytest.mark.interpret

CHUNK = 64
CU_SEQLENS = [0, 0, 1, 37, 37, 120]
NUM_TOKENS = 130
# rel-RMS bounds, 3-5x the measured worst. fp32: split-bf16 products, ~3e-6 (Triton's IEEE dots ~1e-7). bf16:
# outputs rounded to bf16 (~2e-3 alone), score operands rounded to bf16 (score_parts 1) or split (2), the fp16 or
# split inverse. fp16: outputs rounded to fp16 (~3e-4).
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def float64_intra(chunk_start, chunk_len, q, k, v, beta, g, *, group, scale):
    """The definitions, chunk by chunk in float64 (per-pair exps, masked before exp): (w, u, kd, qg, aqk)."""
    num_v_heads, head_k, head_v = v.shape[1], k.shape[-1], v.shape[-1]
    widths = dict(w=head_k, u=head_v, kd=head_k, qg=head_k, aqk=CHUNK)
    out = {name: np.zeros((num_v_heads, len(chunk_start), CHUNK, width)) for name, width in widths.items()}
    i = np.arange(CHUNK)
    lower = (i[:, None] >= i[None, :])[..., None]  # [C, C, 1]
    for c, (start, length) in enumerate(zip(np.asarray(chunk_start), np.asarray(chunk_len))):
        rows = slice(start, start + length)
        for h in range(num_v_heads):
            kc, qc, gc = (np.zeros((CHUNK, head_k)) for _ in range(3))
            vc, bc = np.zeros((CHUNK, head_v)), np.zeros(CHUNK)
            kc[:length], qc[:length], vc[:length] = k[rows, h // group], q[rows, h // group], v[rows, h]
            bc[:length], gc[:length] = beta[rows, h], g[rows, h]
            G = np.cumsum(gc, axis=0)  # [C, K]
            decay = np.exp(np.where(lower, G[:, None, :] - G[None, :, :], -np.inf))  # [C, C, K], i >= j
            kk = np.einsum("ic,jc,ijc->ij", kc, kc, decay)
            A = np.where(i[:, None] > i[None, :], bc[:, None] * kk, 0.0)
            T = np.linalg.inv(np.eye(CHUNK) + A)
            out["w"][h, c] = T @ (bc[:, None] * np.exp(G) * kc)
            out["u"][h, c] = T @ (bc[:, None] * vc)
            out["kd"][h, c] = kc * np.exp(G[-1] - G)
            out["qg"][h, c] = scale * qc * np.exp(G)
            out["aqk"][h, c] = scale * np.einsum("ic,jc,ijc->ij", qc, kc, decay)
    return [out[name] for name in OUTPUTS]


def run_all(seed, dtype, num_heads, group, head_k, head_v, *, cu_seqlens=CU_SEQLENS, num_tokens=NUM_TOKENS,
            strong=False, raw=None, qk_norms=None, interpret=True, triton=True, races=True, **tuning):
    """(Mosaic GPU outputs, Triton outputs (Nones without `triton`), float64 outputs, chunk_len, G) for fresh
    inputs, padding tokens NaN; `qk_norms`: q's and k's rows scaled to norms in that range and normalized again
    inside the Mosaic GPU kernel (`l2norm=True`), while the Triton kernel gets them normalized before its launch and
    the float64 definitions in float64 (`reference.l2norm`)."""
    rng = np.random.default_rng(seed)
    x = make_inputs(rng, num_tokens, num_heads, num_heads * group, head_k, head_v, strong=strong)
    if raw:
        raw_keys(rng, x, norms=raw)  # keys with norms in that range
    if qk_norms:
        raw_rows(rng, x, norms=qk_norms)
    for name in ("q", "k", "v"):
        x[name][cu_seqlens[-1]:] = np.nan  # padding tokens: never read unmasked
    p = prepared(x, cu_seqlens, dtype, interpret=interpret)  # G from the gate cumsum launch, for the Triton kernel
    g = np.where(np.arange(num_tokens)[:, None, None] < cu_seqlens[-1], x["g"], np.nan)  # the raw gate, NaN padding
    inputs = (p.q, p.k, p.v, p.beta)
    # chunks with 0, 1 or 2 checkpoints: the kernel writes G's rows at those with some
    checkpoint_count = jnp.asarray(rng.integers(0, 3, size=p.lay.chunk_len.shape[0]), jnp.int32)
    mosaic_interpret = plgpu.InterpretGPUParams(detect_races=races) if interpret else False
    mosaic = mosaic_kda_intra(p, *inputs, jnp.asarray(g, jnp.float32), checkpoint_count=checkpoint_count,
                              interpret=mosaic_interpret, l2norm=bool(qk_norms), **tuning)
    if interpret and races:
        assert not get_races().races_found, f"seed {seed}: SMEM race (printed above)"
    check_gate_cumsum(seed, *mosaic[5:], np.asarray(p.G), np.asarray(checkpoint_count))
    triton_outputs = [None] * len(OUTPUTS)
    if triton:
        normed = (cumsum.l2norm(p.q), cumsum.l2norm(p.k), p.v, p.beta) if qk_norms else inputs
        triton_outputs = [np.asarray(o) for o in triton_kda_intra(p, *normed, p.G, interpret=interpret)]
    q64, k64 = (np.asarray(a, np.float64) for a in (p.q, p.k))
    if qk_norms:
        q64, k64 = reference.l2norm(q64), reference.l2norm(k64)
    exact = float64_intra(p.lay.chunk_start, p.lay.chunk_len, q64, k64, np.asarray(p.v, np.float64),
                          x["beta"].astype(np.float64), x["g"].astype(np.float64), group=group, scale=p.scale)
    return ([np.asarray(o) for o in mosaic[:5]], triton_outputs, exact, np.asarray(p.lay.chunk_len), np.asarray(p.G))


def check_gate_cumsum(seed, G_last, G, expected, checkpoint_count):
    """The kernel's G against the gate cumsum launch's (fp32 sums in another order): G_last at every chunk, G's rows
    at the chunks that hold checkpoints."""
    G_last, G = np.asarray(G_last), np.asarray(G)
    scale = np.abs(expected).max()
    assert np.abs(G_last - expected[:, :, -1]).max() <= 1e-6 * scale, f"seed {seed}: G_last"
    held = checkpoint_count > 0
    assert np.abs(G[:, held] - expected[:, held]).max() <= 1e-6 * scale, f"seed {seed}: G at checkpoint chunks"


def check_outputs(seed, dtype, mosaic, triton, exact, chunk_len, tol):
    padding = np.arange(CHUNK)[None, :] >= chunk_len[:, None]  # [NC, C]
    errors = {}
    for name, m, t, e in zip(OUTPUTS, mosaic, triton, exact):
        where = f"{name}, {jnp.dtype(dtype).name}, seed {seed}"
        assert m.shape == e.shape and m.dtype == jnp.dtype(dtype), where
        assert np.isfinite(m).all(), where
        assert not m[:, padding].any(), where  # padding rows are zero, as the Triton kernels write them
        errors[name] = rel_rms(m, e), None if t is None else rel_rms(m, t)
        assert errors[name][0] <= tol, (where, "vs float64", errors[name][0])
        if t is not None:
            assert errors[name][1] <= tol, (where, "vs triton", errors[name][1])
    aqk = mosaic[OUTPUTS.index("aqk")].astype(np.float32)
    assert not np.triu(aqk, 1).any()  # causal: nothing above the diagonal
    return errors


@pytest.fixture(autouse=True)
def fresh_interpreter():
    """A kernel that raised leaves the interpreter's shared state behind; later kernels would trip over it."""
    yield
    reset_gpu_interpret_mode_state()


# the defaults (bf16, score_parts 1 in fp16, the "blocked" inverse) and score_dtype="input" on two key heads run in
# `test_fp16_score_operands_beat_bf16_ones`, with the same checks
@pytest.mark.parametrize("dtype, num_heads, group, tuning", [
    (jnp.bfloat16, 1, 2, dict(score_parts=2, inverse="split")),
    (jnp.float16, 1, 1, {}),
    (jnp.float16, 1, 1, dict(inverse="split")),  # the split inverse's terms in the I/O dtype
    (jnp.float32, 1, 2, {}),  # everything split
    # under the interpreter "blocked" doubles from s = 2 (it cannot run the substitution): this runs its SMEM layout
    # (the pad tile nested with beta V's and the inverse's tiles) under the race detector
    (jnp.bfloat16, 1, 2, dict(inverse="blocked")),
])
def test_matches_triton_and_float64(dtype, num_heads, group, tuning):
    seed = int(np.random.SeedSequence().entropy % 2 ** 32)
    outputs = run_all(seed, dtype, num_heads, group, 64, 64, **tuning)
    check_outputs(seed, dtype, *outputs[:4], tol=TOL[dtype])


# fp16 I/O: beta v ~ 2 / |k|^2 must itself fit fp16, so the keys' norms span fewer decades there
@pytest.mark.parametrize("dtype, norms", [(jnp.bfloat16, (1e-3, 1e3)), (jnp.float16, (0.015, 60.0))])
def test_raw_keys_of_any_norm(dtype, norms):
    """`delta_rule.pallas_mosaic_gpu.intra`'s test of the same name: keys over several decades of norm, near-parallel,
    beta = beta' / |k|^2 with beta' up to 2; the similarity keeps the fp16 inverse's operands in range. Against float64
    only (the Triton kernel's own rounding on such keys is not the property)."""
    seed = int(np.random.SeedSequence().entropy % 2 ** 32)
    outputs = run_all(seed, dtype, 1, 2, 64, 64, raw=norms, triton=False, races=False)
    check_outputs(seed, dtype, *outputs[:4], tol=TOL[dtype])


# 16-bit I/O only: the pipeline, which alone sets l2norm, declines fp32 inputs
@pytest.mark.parametrize("dtype, tuning", [(jnp.bfloat16, {}), (jnp.float16, dict(inverse="f16"))])
def test_l2norm_in_kernel(dtype, tuning):
    """`l2norm=True` (use_qk_l2norm, applied as q and k land) on rows of norms over four decades: the outputs of the
    definitions on unit rows, and of the Triton kernel on rows normalized before its launch."""
    seed = int(np.random.SeedSequence().entropy % 2 ** 32)
    outputs = run_all(seed, dtype, 1, 2, 64, 64, qk_norms=(0.01, 100.0), **tuning)
    check_outputs(seed, dtype, *outputs[:4], tol=TOL[dtype])


def test_fp16_score_operands_beat_bf16_ones():
    """The same inputs with the score operands rounded to bf16 and to fp16 (the default): each passes
    `test_matches_triton_and_float64`'s checks, and fp16's 3 more significand bits must show in the query scores AQK
    against float64 (rounded to bf16 in both; W's error is its bf16 right-hand side's, not the scores')."""
    seed = int(np.random.SeedSequence().entropy % 2 ** 32)
    errors = {}
    for score_dtype in ("input", "float16"):
        mosaic, triton, exact, chunk_len, _ = run_all(seed, jnp.bfloat16, 2, 1, 64, 64, score_dtype=score_dtype,
                                                      races=score_dtype == "float16")
        errors[score_dtype] = check_outputs(seed, jnp.bfloat16, mosaic, triton, exact, chunk_len, TOL[jnp.bfloat16])
    assert errors["float16"]["aqk"][0] < 0.85 * errors["input"]["aqk"][0], (seed, errors)


def test_strong_decays_stay_exact():
    dtype = jnp.bfloat16
    seed = int(np.random.SeedSequence().entropy % 2 ** 32)
    *outputs, G = run_all(seed, dtype, 1, 2, 64, 64, strong=True, triton=False, races=False)
    chunk_len = outputs[3]
    real = np.arange(CHUNK)[None, :] < chunk_len[:, None]  # [NC, C]
    # a naive exp(G_i) exp(-G_j) factorisation would overflow fp32 on these chunks
    assert np.max(-G[:, real]) > 200, f"seed {seed}"
    check_outputs(seed, dtype, *outputs, tol=TOL[dtype])


def test_supports_reasons(monkeypatch):
    q = jnp.zeros((8, 2, 64), jnp.bfloat16)
    v = jnp.zeros((8, 4, 64), jnp.bfloat16)
    beta, g = jnp.zeros((8, 4)), jnp.zeros((8, 4, 64))
    supports = functools.partial(mki.supports, num_chunks=1, interpret=True)
    assert supports(q, q, v, beta, g) is None
    assert "chunk" in supports(q, q, v, beta, g, chunk=32)
    assert "K:" in supports(q[..., :32], q[..., :32], v, beta, g[..., :32])
    assert "V:" in supports(q, q, jnp.zeros((8, 4, 256), jnp.bfloat16), beta, g)
    assert "multiple" in supports(q, q, v[:, :3], beta[:, :3], g[:, :3])
    assert "dtype" in supports(q.astype(jnp.int8), q, v, beta, g)
    assert "g:" in supports(q, q, v, beta, g[:, :2])
    assert "G" in supports(q, q, v, beta, jnp.zeros((4, 1, CHUNK, 64)))
    assert "tuning" in supports(q, q, v, beta, g, block_v=64)
    assert "score_parts" in supports(q, q, v, beta, g, score_parts=3)
    assert "score_dtype" in supports(q, q, v, beta, g, score_dtype="bfloat16")
    assert "inverse" in supports(q, q, v, beta, g, inverse="f32")
    q32, v32 = jnp.zeros((8, 2, 64)), jnp.zeros((8, 4, 64))
    assert "inverse" in supports(q32, q32, v32, beta, g, inverse="f16")
    assert "inverse" in supports(q32, q32, v32, beta, g, inverse="blocked")
    assert supports(q, q, v, beta, g, inverse="blocked") is None
    # the pad tile shares the bytes of beta V's and the inverse's tiles
    assert mki._smem_bytes(128, 128, jnp.dtype(jnp.bfloat16), 1, "blocked") == mki._smem_bytes(
        128, 128, jnp.dtype(jnp.bfloat16), 1, "f16")
    smem = mki._smem_bytes(128, 128, jnp.dtype(jnp.bfloat16), 2, "split")
    monkeypatch.setattr(mki, "SMEM_LIMIT", smem - 1)
    q128, v128 = jnp.zeros((8, 2, 128), jnp.bfloat16), jnp.zeros((8, 4, 128), jnp.bfloat16)
    g128 = jnp.zeros((8, 4, 128))
    assert "SMEM" in supports(q128, q128, v128, beta, g128, score_parts=2, inverse="split")
    assert supports(q128, q128, v128, beta, g128) is None
    # the chunk axis lands on CUDA's grid y (at most 65535 CTAs)
    assert "65536 CTAs" in mki.supports(q, q, v, beta, g, num_chunks=65536, interpret=True)
    if jax.default_backend() == "cpu":
        assert "backend" in mki.supports(q, q, v, beta, g, num_chunks=1)
    with pytest.raises(ValueError, match="group"):
        chunks = jnp.zeros(1, jnp.int32)
        mki.kda_intra(chunks, chunks, q, q, v, beta, g, chunk=CHUNK, group=1, scale=0.1, interpret=True)


@pytest.mark.parametrize("dtype, head_k, head_v, tuning, two_per_sm", [
    (jnp.bfloat16, 128, 128, {}, True),  # the default: two CTAs share an SM
    (jnp.bfloat16, 128, 128, dict(score_parts=2, inverse="split"), False),
    (jnp.float32, 128, 128, {}, False),  # 210 KB of SMEM, the largest configuration
    (jnp.bfloat16, 128, 128, dict(inverse="blocked"), True),  # the substitution lowers only here
    (jnp.float16, 64, 64, dict(inverse="blocked"), True),
    (jnp.bfloat16, 128, 128, dict(l2norm=True), True),  # the default with use_qk_l2norm, SMEM unchanged
])
def test_lowers_for_sm90(monkeypatch, dtype, head_k, head_v, tuning, two_per_sm):
    """The whole Pallas -> Mosaic GPU lowering for an H100/H200 runs on CPU: it checks what the interpreter does
    not (SMEM within 227 KB, or within 113 KB where two CTAs must share an SM's 228 KB, TMA sources contiguous,
    register layouts). Only PTX and ptxas need the GPU machine."""
    from jax import export
    from jax.experimental.mosaic.gpu import core as mosaic_core

    # the backend check is about running the kernel; lowering for sm_90 needs no GPU
    monkeypatch.setattr(mki, "supports", lambda *args, **kwargs: None)
    if two_per_sm:  # the lowering's own SMEM count, barriers included; each CTA also takes 1 KB of the SM
        monkeypatch.setattr(mosaic_core, "_SMEM_SIZE_BOUND", 113 * 1024)
    num_tokens, num_heads, num_chunks = 1000, 2, 17
    arg = jax.ShapeDtypeStruct
    args = (arg((num_chunks,), jnp.int32), arg((num_chunks,), jnp.int32), arg((num_tokens, num_heads, head_k), dtype),
            arg((num_tokens, num_heads, head_k), dtype), arg((num_tokens, 2 * num_heads, head_v), dtype),
            arg((num_tokens, 2 * num_heads), dtype), arg((num_tokens, 2 * num_heads, head_k), jnp.float32),
            arg((num_chunks,), jnp.int32))
    fn = jax.jit(lambda *a: mki.kda_intra(*a[:7], checkpoint_count=a[7], chunk=CHUNK, group=2, scale=0.1, **tuning))
    assert "kda_intra_mosaic_gpu" in export.export(fn, platforms=["cuda"])(*args).mlir_module()


@pytest.mark.parametrize("log_s", range(4))
def test_reference_rows_shuffle_plan(log_s):
    """The shuffle plan of `tiles.reference_rows` (the kernel's levels s <= 8 off the interpreter, which cannot run
    warp shuffles) on a numpy model of one warp's WGMMA-layout registers, as PTX lays out a wgmma accumulator: lane l,
    register half h, column group m, element e hold row 8h + (l >> 2), column 8m + 2(l & 3) + e. Every lane sends
    its register the plan names (its bottom one for the top half when the plan says so), reads from the plan's source
    lane, and must end with row (i & -2s) + s of a fresh random tile in every register."""
    from jaxckpt.ops.common import pallas_mosaic_gpu_tiles as tiles

    x = np.random.default_rng().standard_normal((16, 32))
    lane, half, group, elem = np.meshgrid(np.arange(32), np.arange(2), np.arange(4), np.arange(2), indexing="ij")
    rows, cols = 8 * half + (lane >> 2), 8 * group + 2 * (lane & 3) + elem
    src, top_reads_bottom = tiles.reference_source(np.arange(32), log_s, np)
    sent_half = np.where(half == 1, 1, (top_reads_bottom[src[lane]] != 0).astype(int))
    got = x[8 * sent_half + (src[lane] >> 2), cols]
    s = 1 << log_s
    np.testing.assert_array_equal(got, x[(rows & -2 * s) + s, cols])
