"""The sequence split of the Mosaic GPU state pass (`config=DeltaPallasMosaicGpuConfig(pieces=P)`) on a Hopper GPU:
one long row at (1, 8192, 16) K = V = 128, bf16, with an initial state and checkpoints (on the piece boundaries of
P = 2 and 4, inside chunks, at 1 and len - 1), for P = 1, 2, 4 and "auto", against float64 and against the unsplit
pass (`pieces=1`, `state_terms=2`: the same intermediates, whole rows); and varlen rows off the 8-row TMA tile grid
with P = 3 (rows shorter than P chunks: empty pieces). State "v2" runs with `state_terms=2` (hi + lo products) for the
tight agreement with the unsplit pass, and once with the default one-term chain (`state_terms=1`), which rounds S and
v_new to 16 bits where they meet W and KD and so agrees with it only to the bf16 class. The fused GDN pass
(`{"state": "fused", "pieces": P}`: `gdn_kkt`, then `gdn_fused_lanes` in the same split) on the same long row for
P = 1, 4 and "auto" and on the varlen rows with P = 3, against float64 and the unsplit pass.
This is where the map pass's tensor-core rounding (16-bit hi + lo products over the columns of [I | 0]) meets the
scan; the CPU tests (tests/ops/test_pallas_mosaic_gpu_split.py) check the split's algebra and the interpreter.

Run on the GPU machine:
`JAXCKPT_GPU_TESTS=1 JAX_PLATFORMS=cuda python -m pytest -q -s tests/gpu/test_mosaic_gpu_split.py`.
"""

import numpy as np
import pytest

from jaxckpt.ops import DeltaPallasMosaicGpuConfig as Config
from tests.gpu.mosaic_cases import BF16_TOL, delta_case, entries
from tests.numerics import rel_rms

pytestmark = pytest.mark.gpu

AGREE_TOL = 2e-3  # against the unsplit pass: the same intermediates, a different order of the fp32 products
# state "v2" with one 16-bit term per state product (the default) against it: its own rounding of S and v_new
ONE_TERM_AGREE_TOL = BF16_TOL
# state "fused" against it: different intermediates (no bf16 W, U), so they differ by about its own error
FUSED_AGREE_TOL = BF16_TOL
UNSPLIT = Config(pieces=1, state_terms=2)
LENGTH = 8192
# 1, inside chunks, P = 4's boundaries (2048, 6144), P = 2's and 4's (4096), len - 1
OFFSETS = (1, 100, 2048, 3000, 4096, 6144, 8191)


def astray_tokens(o, o_unsplit):
    """Message naming the tokens whose output differs from the unsplit pass's (the same intermediates) by more than
    2% of its RMS: a piece whose output tiles went astray shows as a block; empty when none does."""
    o, o_unsplit = np.asarray(o, np.float64), np.asarray(o_unsplit, np.float64)
    token_err = np.sqrt(np.mean((o - o_unsplit) ** 2, axis=(1, 2)))
    bad = np.flatnonzero(token_err > 0.02 * np.sqrt(np.mean(o_unsplit ** 2)))
    return f"tokens {bad[:16].tolist()} ({bad.size} in all) differ from the unsplit pass" if bad.size else ""


@pytest.fixture(scope="module", params=["gdn", "kda"])
def long_row(request):
    op = request.param
    fn, reference = entries(op)
    bf, g, beta, meta = delta_case(op, np.random.default_rng(17), (LENGTH,), (OFFSETS,), heads=16, long_memory=True)
    inputs = [np.asarray(a, np.float32) for a in bf]
    expected = reference(*inputs, g, beta, **meta)
    # the initial state still shapes the final one: the row's pieces really carry state across their boundaries
    forgetful = reference(*inputs, g, beta, **dict(meta, initial_state=None))
    assert rel_rms(forgetful[1], expected[1]) > 0.03, rel_rms(forgetful[1], expected[1])
    unsplit = fn(*bf, g, beta, **meta, config=UNSPLIT)
    return op, fn, (bf, g, beta, meta), expected, unsplit


def long_row_failures(label, got, expected, unsplit, agree_tol):
    """What is off in (o, final, checkpoints) against float64 and against the unsplit pass, printed as it goes; each
    checkpoint on its own too (one on a piece boundary is that piece's start state, from the scan alone)."""
    failures = []
    for name, a, e, b in zip(("o", "final", "checkpoints"), got, expected, unsplit):
        err, agree = rel_rms(a, e), rel_rms(a, b)
        print(f"{label} {name}: rel-RMS {err:.2e} vs float64, {agree:.2e} vs the unsplit pass (it vs float64 "
              f"{rel_rms(b, e):.2e})")
        if not (np.isfinite(np.asarray(a, np.float32)).all() and err < BF16_TOL and agree < agree_tol):
            failures.append(f"{name}: {err:.2e} vs float64, {agree:.2e} vs unsplit")
    for m, offset in enumerate(OFFSETS):
        err = rel_rms(got[2][m], expected[2][m])
        if not err < BF16_TOL:
            failures.append(f"checkpoint at {offset}: {err:.2e} vs float64")
    return failures


# (1, 2) is the unsplit pass itself: there only its float64 check bites
@pytest.mark.parametrize("pieces, state_terms", [(1, 2), (2, 2), (4, 2), ("auto", 2), ("auto", 1)])
def test_long_row_pieces_against_float64_and_unsplit(long_row, pieces, state_terms):
    op, fn, (bf, g, beta, meta), expected, unsplit = long_row
    got = fn(*bf, g, beta, **meta, config=Config(pieces=pieces, state_terms=state_terms))
    failures = long_row_failures(f"{op} (1, {LENGTH}, 16) state v2 pieces={pieces} state_terms={state_terms}", got,
                                 expected, unsplit, AGREE_TOL if state_terms == 2 else ONE_TERM_AGREE_TOL)
    assert not failures, "\n".join(failures)


ROWS = ((1500, 1, 547, 37), ((1, 64, 500, 1000, 1499), (), (64, 500), (1, 36)))


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_varlen_rows_off_the_tile_grid_three_pieces(op):
    fn, reference = entries(op)
    lengths, offsets = ROWS
    bf, g, beta, meta = delta_case(op, np.random.default_rng(19), lengths, offsets, heads=16)
    expected = reference(*(np.asarray(a, np.float32) for a in bf), g, beta, **meta)
    unsplit = fn(*bf, g, beta, **meta, config=UNSPLIT)
    got = fn(*bf, g, beta, **meta, config=Config(pieces=3, state_terms=2))
    for name, a, e, b in zip(("o", "final", "checkpoints"), got, expected, unsplit):
        err, agree = rel_rms(a, e), rel_rms(a, b)
        print(f"{op} rows {lengths} state v2 pieces=3 {name}: rel-RMS {err:.2e} vs float64, {agree:.2e} vs unsplit")
        assert np.isfinite(np.asarray(a, np.float32)).all() and err < BF16_TOL and agree < AGREE_TOL, name
    assert not astray_tokens(got[0], unsplit[0]), astray_tokens(got[0], unsplit[0])


@pytest.mark.parametrize("pieces", [1, 4, "auto"])
def test_long_row_state_fused_against_float64_and_unsplit(long_row, pieces):
    op, fn, (bf, g, beta, meta), expected, unsplit = long_row
    if op == "kda":
        with pytest.raises(ValueError, match="fused GDN pass"):
            fn(*bf, g, beta, **meta, config=Config(state="fused"))
        return
    got = fn(*bf, g, beta, **meta, config=Config(state="fused", pieces=pieces))
    failures = long_row_failures(f"gdn (1, {LENGTH}, 16) state fused pieces={pieces}", got, expected, unsplit,
                                 FUSED_AGREE_TOL)
    assert not failures, "\n".join(failures)


def test_varlen_rows_off_the_tile_grid_state_fused_three_pieces():
    fn, reference = entries("gdn")
    lengths, offsets = ROWS
    bf, g, beta, meta = delta_case("gdn", np.random.default_rng(23), lengths, offsets, heads=16)
    expected = reference(*(np.asarray(a, np.float32) for a in bf), g, beta, **meta)
    unsplit = fn(*bf, g, beta, **meta, config=UNSPLIT)
    got = fn(*bf, g, beta, **meta, config=Config(state="fused", pieces=3))
    for name, a, e, b in zip(("o", "final", "checkpoints"), got, expected, unsplit):
        err, agree = rel_rms(a, e), rel_rms(a, b)
        print(f"gdn rows {lengths} state fused pieces=3 {name}: rel-RMS {err:.2e} vs float64, {agree:.2e} vs unsplit")
        assert np.isfinite(np.asarray(a, np.float32)).all() and err < BF16_TOL and agree < FUSED_AGREE_TOL, name
    assert not astray_tokens(got[0], unsplit[0]), astray_tokens(got[0], unsplit[0])
