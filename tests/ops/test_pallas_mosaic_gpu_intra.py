"""The Mosaic GPU GDN intra-chunk kernel (`delta_rule.pallas_mosaic_gpu.intra.gdn_intra`) under Mosaic GPU's CPU
interpreter, against the Triton-lowered `_intra_kernel_v2` (interpret mode) and an independent float64 numpy computation
of the definitions, output by output; fresh random inputs each run (the seed is in every failure message).

Rows of lengths 0, 1, 36, 0, 83 then 10 padding tokens holding NaN: chunks start at unaligned tokens, the last one
is partial and its TMA window runs past T (zero-filled), and the NaNs check that nothing past a chunk's length
leaks into its outputs. The interpreter computes bf16 x bf16 wgmmas exactly in fp32, as the tensor cores do.
Every value of every tuning option (`inverse`, `chunks_per_cta`, `landing`) runs in some case, the first version's
combination included. The interpreter sees logical arrays: the swizzled landing's addressing only lowers here and
is checked on the GPU (`tests/gpu/test_mosaic_gpu_intra.py`).

The tuning cases run with the interpreter's race detector (the cases whose property is numerical, raw keys' norms, run
the same SMEM schedule as a tuning case and skip it: it costs a third of an interpreted run). It tracks TMA copies and
RefUnion alias groups (it flags, e.g., a score output's TMA store still reading a tile the inverse overwrites) but not
wgmma operand reads (no vector clocks on wgmma in jax 0.11.2), so a missing `commit_smem` before a wgmma is not caught
here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# no public accessor in jax 0.11.2 for the race detector's verdict or for resetting after a failed kernel
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races, reset_gpu_interpret_mode_state
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxckpt.ops.delta_rule import cumsum, reference
from jaxckpt.ops.delta_rule.pallas_mosaic_gpu import intra as mgi
from tests.numerics import rel_rms
from tests.ops.intra_cases import OUTPUTS, gate_cumsum, layout, raw_keys, raw_rows, triton_intra
from tests.ops.intra_cases import make_gdn_inputs as make_inputs

pytestmark = pytest.mark.interpret

CHUNK = 64
CU_SEQLENS = [0, 0, 1, 37, 37, 120]
NUM_TOKENS = 130
# rel-RMS bounds, 3-6x the measured worst. fp32: the split-bf16 products land at ~5e-6 (the Triton kernel's IEEE dots
# ~1e-7). bf16: ~2.5e-3 (Triton ~1.7e-3): outputs are rounded to bf16, and W, U use bf16 right-hand sides, as FLA;
# fp16 the same at 3 more mantissa bits.
TOL = {jnp.float32: 3e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def float64_intra(chunk_start, chunk_len, q, k, v, beta, g, *, group, scale):
    """The definitions, chunk by chunk in float64: (w, u, kd, qg, aqk) as [HV, NC, C, ...]."""
    q, k, v, beta, g = (np.asarray(x, np.float64) for x in (q, k, v, beta, g))
    num_v_heads, head_k, head_v = v.shape[1], k.shape[-1], v.shape[-1]
    widths = dict(w=head_k, u=head_v, kd=head_k, qg=head_k, aqk=CHUNK)
    out = {name: np.zeros((num_v_heads, len(chunk_start), CHUNK, width)) for name, width in widths.items()}
    i = np.arange(CHUNK)
    lower = i[:, None] >= i[None, :]
    for c, (start, length) in enumerate(zip(np.asarray(chunk_start), np.asarray(chunk_len))):
        rows = slice(start, start + length)
        for h in range(num_v_heads):
            kc, qc, vc = np.zeros((CHUNK, head_k)), np.zeros((CHUNK, head_k)), np.zeros((CHUNK, head_v))
            bc, gc = np.zeros(CHUNK), np.zeros(CHUNK)
            kc[:length], qc[:length], vc[:length] = k[rows, h // group], q[rows, h // group], v[rows, h]
            bc[:length], gc[:length] = beta[rows, h], g[rows, h]
            G = np.cumsum(gc)
            decay = np.where(lower, np.exp(np.where(lower, G[:, None] - G[None, :], -np.inf)), 0.0)
            A = np.where(i[:, None] > i[None, :], bc[:, None] * (kc @ kc.T) * decay, 0.0)
            T = np.linalg.inv(np.eye(CHUNK) + A)
            out["w"][h, c] = T @ (bc[:, None] * np.exp(G)[:, None] * kc)
            out["u"][h, c] = T @ (bc[:, None] * vc)
            out["kd"][h, c] = kc * np.exp(G[-1] - G)[:, None]
            out["qg"][h, c] = scale * qc * np.exp(G)[:, None]
            out["aqk"][h, c] = scale * (qc @ kc.T) * decay
    return [out[name] for name in OUTPUTS]


def run_both(seed, dtype, num_heads, group, head_k, head_v, *, cu_seqlens=CU_SEQLENS, num_tokens=NUM_TOKENS,
             interpret=True, raw=None, qk_norms=None, triton=True, races=True, **tuning):
    """(Mosaic GPU outputs, Triton outputs (Nones without `triton`), float64 outputs, chunk_len) for fresh inputs,
    padding tokens NaN; `raw`: keys with norms in that range (`raw_keys`); `qk_norms`: q's and k's rows scaled to
    norms in that range and normalized again inside the Mosaic GPU kernel (`l2norm=True`), while the Triton kernel
    gets them normalized before its launch (`cumsum.l2norm`) and the float64 definitions in float64
    (`reference.l2norm`, FLA's eps)."""
    rng = np.random.default_rng(seed)
    x = make_inputs(rng, num_tokens, num_heads, num_heads * group, head_k, head_v)
    if raw:
        raw_keys(rng, x, norms=raw)
    if qk_norms:
        raw_rows(rng, x, norms=qk_norms)
    for name in ("q", "k", "v"):
        x[name][cu_seqlens[-1]:] = np.nan  # padding tokens: never read unmasked
    q, k, v = (jnp.asarray(x[name], dtype) for name in ("q", "k", "v"))
    beta, g = jnp.asarray(x["beta"]), jnp.asarray(x["g"])
    chunk_start, chunk_len = layout(cu_seqlens, num_tokens)
    G = gate_cumsum(chunk_start, chunk_len, g, interpret=interpret)
    options = dict(group=group, scale=head_k ** -0.5)
    mosaic_interpret = plgpu.InterpretGPUParams(detect_races=races) if interpret else False
    mosaic = mgi.gdn_intra(chunk_start, chunk_len, q, k, v, beta, G, chunk=CHUNK, interpret=mosaic_interpret,
                           l2norm=bool(qk_norms), **options, **tuning)
    if interpret and races:
        assert not get_races().races_found, f"seed {seed}: SMEM race (printed above)"
    triton_outputs = [None] * len(OUTPUTS)
    if triton:
        q_in, k_in = (cumsum.l2norm(q), cumsum.l2norm(k)) if qk_norms else (q, k)
        triton_outputs = [np.asarray(o) for o in triton_intra(chunk_start, chunk_len, q_in, k_in, v, beta, G,
                                                              interpret=interpret, **options)]
    q64, k64 = (np.asarray(a, np.float64) for a in (q, k))
    if qk_norms:
        q64, k64 = reference.l2norm(q64), reference.l2norm(k64)
    exact = float64_intra(chunk_start, chunk_len, q64, k64, np.asarray(v, np.float64), x["beta"], x["g"], **options)
    return [np.asarray(o) for o in mosaic], triton_outputs, exact, np.asarray(chunk_len)


def check_outputs(seed, dtype, mosaic, triton, exact, chunk_len, tol):
    padding = np.arange(CHUNK)[None, :] >= chunk_len[:, None]  # [NC, C]
    for name, m, t, e in zip(OUTPUTS, mosaic, triton, exact):
        where = f"{name}, {jnp.dtype(dtype).name}, seed {seed}"
        assert m.shape == e.shape and m.dtype == jnp.dtype(dtype), where
        assert np.isfinite(m).all(), where
        assert not m[:, padding].any(), where  # padding rows are zero, as the Triton kernel writes them
        assert rel_rms(m, e) <= tol, (where, "vs float64", rel_rms(m, e))
        if t is not None:
            assert rel_rms(m, t) <= tol, (where, "vs triton", rel_rms(m, t))
    aqk = mosaic[OUTPUTS.index("aqk")].astype(np.float32)
    assert not np.triu(aqk, 1).any()  # causal: nothing above the diagonal


@pytest.fixture(autouse=True)
def fresh_interpreter():
    """A kernel that raised leaves the interpreter's shared state behind; later kernels would trip over it."""
    yield
    reset_gpu_interpret_mode_state()


@pytest.mark.parametrize("dtype, num_heads, group, head_k, head_v, tuning", [
    (jnp.float32, 1, 2, 64, 64, {}),
    (jnp.bfloat16, 2, 1, 64, 64, {}),
    (jnp.bfloat16, 1, 2, 64, 128, dict(inverse="split", chunks_per_cta=1, landing="rows")),  # the first version
    (jnp.float16, 1, 1, 128, 64, {}),
    # several chunks per CTA: 4 chunks in blocks of 3 (the second block runs 1 of its 3 iterations)
    (jnp.bfloat16, 1, 2, 128, 128, dict(inverse="f16", chunks_per_cta=3)),
    (jnp.float16, 2, 1, 64, 64, dict(inverse="split", chunks_per_cta=2, landing="rows")),
    # under the interpreter "blocked" doubles from s = 2 (it cannot run the substitution): this checks its SMEM
    # layout (the pad tile in the RefUnion) under the race detector and the rest of the kernel
    (jnp.bfloat16, 1, 2, 64, 128, dict(inverse="blocked")),
    (jnp.float16, 2, 1, 128, 64, dict(inverse="blocked", landing="rows")),
])
def test_matches_triton_and_float64(dtype, num_heads, group, head_k, head_v, tuning):
    seed = int(np.random.SeedSequence().entropy % 2 ** 32)
    check_outputs(seed, dtype, *run_both(seed, dtype, num_heads, group, head_k, head_v, **tuning), tol=TOL[dtype])


# fp16 I/O: beta v ~ 2 / |k|^2 must itself fit fp16, so the keys' norms span three decades there
@pytest.mark.parametrize("dtype, norms", [(jnp.bfloat16, (1e-3, 1e3)), (jnp.float16, (0.015, 60.0))])
def test_raw_keys_of_any_norm(dtype, norms):
    """Keys with norms over three to six decades, near-parallel, beta = beta' / |k|^2 (beta' up to 2) and mild to
    strong decays: A's entries reach beta' |k_i| / |k_j| ~ 1e3-1e6, past what the fp16 inverse holds unscaled; the
    kernel's similarity D A D^-1 (module docstring, step 4) keeps its operands at most 2 beta'. Against float64 only
    (the Triton kernel's own rounding on such keys is not the property)."""
    seed = int(np.random.SeedSequence().entropy % 2 ** 32)
    outputs = run_both(seed, dtype, 1, 2, 64, 64, raw=norms, triton=False, races=False)
    check_outputs(seed, dtype, *outputs, tol=TOL[dtype])


# 16-bit I/O only: the pipeline, which alone sets l2norm, declines fp32 inputs
@pytest.mark.parametrize("dtype, tuning", [(jnp.bfloat16, {}), (jnp.float16, dict(inverse="f16", chunks_per_cta=2))])
def test_l2norm_in_kernel(dtype, tuning):
    """`l2norm=True` (use_qk_l2norm, applied as the kernel reads q and k) on rows of norms over four decades: the
    outputs of the definitions on unit rows, and of the Triton kernel on rows normalized before its launch."""
    seed = int(np.random.SeedSequence().entropy % 2 ** 32)
    check_outputs(seed, dtype, *run_both(seed, dtype, 1, 2, 64, 64, qk_norms=(0.01, 100.0), **tuning),
                  tol=TOL[dtype])


def test_supports_reasons():
    q = jnp.zeros((8, 2, 64), jnp.bfloat16)
    v = jnp.zeros((8, 4, 64), jnp.bfloat16)
    beta, G = jnp.zeros((8, 4)), jnp.zeros((4, 1, CHUNK))
    assert mgi.supports(q, q, v, beta, G, interpret=True) is None
    assert "chunk" in mgi.supports(q, q, v, beta, G, chunk=32, interpret=True)
    assert "K:" in mgi.supports(q[..., :32], q[..., :32], v, beta, G, interpret=True)
    assert "V:" in mgi.supports(q, q, jnp.zeros((8, 4, 256)), beta, G, interpret=True)
    assert "multiple" in mgi.supports(q, q, v[:, :3], beta[:, :3], G[:3], interpret=True)
    assert "dtype" in mgi.supports(q.astype(jnp.int8), q, v, beta, G, interpret=True)
    assert "tuning" in mgi.supports(q, q, v, beta, G, interpret=True, block_v=64)
    assert "inverse" in mgi.supports(q, q, v, beta, G, interpret=True, inverse="tf32")
    assert "inverse" in mgi.supports(q, q.astype(jnp.float32), v, beta, G, interpret=True, inverse="f16")
    assert "inverse" in mgi.supports(q, q.astype(jnp.float32), v, beta, G, interpret=True, inverse="blocked")
    assert "chunks_per_cta" in mgi.supports(q, q, v, beta, G, interpret=True, inverse="blocked", chunks_per_cta=2)
    assert mgi.supports(q, q, v, beta, G, interpret=True, inverse="blocked", landing="rows") is None
    assert "chunks_per_cta" in mgi.supports(q, q, v, beta, G, interpret=True, chunks_per_cta=0)
    assert "chunks_per_cta" in mgi.supports(q, q, v.astype(jnp.float32), beta, G, interpret=True, chunks_per_cta=2)
    assert "landing" in mgi.supports(q, q, v, beta, G, interpret=True, landing="tiled")
    assert mgi.supports(q, q, v, beta, G, interpret=True, inverse="split", chunks_per_cta=4, landing="rows") is None
    # the defaults: "blocked" for 16-bit I/O, except with several chunks per CTA, which it does not take
    assert mgi.default_tuning(jnp.dtype(jnp.bfloat16))["inverse"] == "blocked"
    assert mgi.default_tuning(jnp.dtype(jnp.bfloat16), chunks_per_cta=2)["inverse"] == "f16"
    assert mgi.default_tuning(jnp.dtype(jnp.float32))["inverse"] == "split"
    # the chunk axis lands on CUDA's grid y (at most 65535 CTAs); only G's shape is read
    wide_G = jax.ShapeDtypeStruct((4, 65536, CHUNK), jnp.float32)
    assert "65536 CTAs" in mgi.supports(q, q, v, beta, wide_G, interpret=True)
    assert mgi.supports(q, q, v, beta, wide_G, interpret=True, chunks_per_cta=2) is None
    if jax.default_backend() == "cpu":
        assert "backend" in mgi.supports(q, q, v, beta, G)
    with pytest.raises(ValueError, match="group"):
        mgi.gdn_intra(None, None, q, q, v, beta, G, chunk=CHUNK, group=1, scale=0.1, interpret=True)


@pytest.mark.parametrize("dtype, head_k, head_v, tuning, two_per_sm", [
    (jnp.bfloat16, 128, 128, dict(inverse="split", chunks_per_cta=1, landing="rows"), True),
    (jnp.bfloat16, 128, 128, dict(inverse="f16", chunks_per_cta=4, landing="swizzled"), True),
    (jnp.float16, 64, 128, dict(inverse="split", chunks_per_cta=2, landing="rows"), True),
    (jnp.float32, 128, 128, {}, False),
    # the substitution (Mosaic GPU code the interpreter cannot run) lowers only here; its pad tile is aliased
    (jnp.bfloat16, 128, 128, dict(inverse="blocked"), True),
    (jnp.float16, 64, 64, dict(inverse="blocked", landing="rows"), True),
    (jnp.bfloat16, 128, 128, dict(l2norm=True), True),  # the default with use_qk_l2norm: rsqrt lowers
])
def test_lowers_for_sm90(monkeypatch, dtype, head_k, head_v, tuning, two_per_sm):
    """The whole Pallas -> Mosaic GPU lowering for an H100/H200 runs on CPU: it checks what the interpreter does
    not (SMEM within 227 KB, TMA sources contiguous, conflict-free register <-> SMEM transfers). Only PTX and ptxas
    need the GPU machine. `two_per_sm`: the SMEM per CTA leaves room for a second CTA on the SM (228 KB, 1 KB
    reserved per CTA), which the tuning options' speed rests on."""
    from jax import export

    # private: the kernel's SMEM bytes, as Mosaic GPU sizes them for the launch
    from jax.experimental.mosaic.gpu import core as mosaic_core

    # the backend check is about running the kernel; lowering for sm_90 needs no GPU
    monkeypatch.setattr(mgi, "supports", lambda *args, **kwargs: None)
    sizes = []
    tree_size = mosaic_core._smem_tree_size
    monkeypatch.setattr(mosaic_core, "_smem_tree_size", lambda tree: sizes.append(tree_size(tree)) or sizes[-1])
    num_tokens, num_heads, num_chunks = 1000, 2, 17
    arg = jax.ShapeDtypeStruct
    args = (arg((num_chunks,), jnp.int32), arg((num_chunks,), jnp.int32), arg((num_tokens, num_heads, head_k), dtype),
            arg((num_tokens, num_heads, head_k), dtype), arg((num_tokens, 2 * num_heads, head_v), dtype),
            arg((num_tokens, 2 * num_heads), dtype), arg((2 * num_heads, num_chunks, CHUNK), jnp.float32))
    fn = jax.jit(lambda *a: mgi.gdn_intra(*a, chunk=CHUNK, group=2, scale=0.1, **tuning))
    assert "gdn_intra_mosaic_gpu" in export.export(fn, platforms=["cuda"])(*args).mlir_module()
    assert (2 * (max(sizes) + 1024) <= 228 * 1024) == two_per_sm, max(sizes)


def _blocked_inverse_numpy(A, round_operand):
    """The "blocked" inverse in numpy: T_16 by `tiles.substitute_column` in float32 (fma as a float32 multiply-add),
    then the doubling levels s = 16, 32 with operands rounded by round_operand and float32 accumulation."""
    from jaxckpt.ops.common import pallas_mosaic_gpu_tiles as tiles

    f32 = np.float32
    A = A.astype(f32)
    T = np.zeros((CHUNK, CHUNK), f32)
    for base in range(0, CHUNK, tiles.BLOCK):
        for j in range(tiles.BLOCK):
            x = [f32(i == j) for i in range(tiles.BLOCK)]
            x = tiles.substitute_column(x, lambda i, m: -A[base + i, base + m], lambda a, b, c: f32(a * b + c))
            T[base:base + tiles.BLOCK, base + j] = x
    rows, cols = np.indices((CHUNK, CHUNK))
    s = tiles.BLOCK
    while s < CHUNK:
        A_s = np.where((rows // (2 * s) == cols // (2 * s)) & (rows % (2 * s) >= s) & (cols % (2 * s) < s), A, 0)
        dot = lambda a, b: round_operand(a).astype(f32) @ round_operand(b).astype(f32)
        T = T - dot(T, dot(A_s, T))
        s *= 2
    return T


def test_blocked_inverse_math():
    """The substitution's loop (`tiles.substitute_column`, the code the kernel emits) solves each 16 x 16 block
    exactly in fp32, and with the fp16 doubling levels s = 16, 32 the whole inverse lands in the "f16" class
    (module docstring: max |T - T_exact| / max |T| <= 7.8e-4 there) on correlated unit keys."""
    rng = np.random.default_rng(0)
    worst_block, worst = 0.0, 0.0
    for _ in range(4):
        k = rng.standard_normal((CHUNK, 32)) + 3 * rng.standard_normal(32)  # correlated keys
        k /= np.linalg.norm(k, axis=1, keepdims=True)
        beta = rng.uniform(0, 1, CHUNK)
        A = np.tril(beta[:, None] * (k @ k.T), -1)
        exact = np.linalg.inv(np.eye(CHUNK) + A)
        block = np.kron(np.eye(CHUNK // 16), np.ones((16, 16))) > 0
        T16 = _blocked_inverse_numpy(np.where(block, A, 0), lambda x: x)  # no off-block A: the levels add nothing
        worst_block = max(worst_block, np.abs(T16 - np.linalg.inv(np.eye(CHUNK) + np.where(block, A, 0))).max())
        T = _blocked_inverse_numpy(A, lambda x: x.astype(np.float16))
        worst = max(worst, np.abs(T - exact).max() / np.abs(exact).max())
    assert worst_block < 1e-5, worst_block
    assert worst < 1e-3, worst
