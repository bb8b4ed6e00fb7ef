"""The Mosaic GPU SSD (`jaxckpt.ops.ssd.pallas_mosaic_gpu`) in Mosaic GPU's CPU interpreter against the float64
token-by-token reference on the same 16-bit inputs; checkpoints leave outputs and final states bitwise unchanged;
the sequence split and the aligned layout give the plain pass's results; the z gate, fused into the output warpgroup,
rounds y once, its tiles refilled outside the TMA ring at any ring depth; unsupported calls name their reason. The
sm_90 lowering is checked by exporting for CUDA.

Tolerances: the interpreter's wgmma is an fp32 matmul of the 16-bit tiles, so the carried state (hi + lo operands)
lands near fp32 rounding, while y rounds P and the published state to 16 bits, as the GPU does (rel-RMS ~1e-3 for
bf16 here).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt.ops.common import device
from jaxckpt.ops.ssd import pallas_mosaic_gpu as mosaic
from jaxckpt.ops.ssd import reference
from tests.numerics import rel_rms

pytestmark = pytest.mark.interpret

Y_TOL = 6e-3
STATE_TOL = 1e-4
HEADS, P, N = 2, 64, 64

# rows of lengths 0, 1, 100, 0, 150 (chunk starts off the 8-row grid) and 9 padding tokens; checkpoints at 1, a
# chunk boundary (64), inside chunks and len - 1, then a padded CSR entry
CU_SEQLENS = np.array([0, 0, 1, 101, 101, 251], np.int32)
NUM_TOKENS = 260
CHECKPOINT_CU = np.array([0, 0, 0, 3, 3, 6], np.int32)
CHECKPOINT_OFFSETS = np.array([1, 64, 99, 17, 128, 149, 0], np.int32)


def make_inputs(rng, num_tokens, num_groups, cu_seqlens, layout="vk", *, gate=False):
    num_rows = cu_seqlens.size - 1
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    x = rng.normal(size=(num_tokens, HEADS, P))
    x[cu_seqlens[-1]:] = np.nan  # padding tokens: must stay out of every result
    state = rng.normal(size=(num_rows, HEADS, P, N)) * 0.3
    inputs = dict(x=bf(x), dt=jnp.asarray(rng.normal(size=(num_tokens, HEADS)) - 1.0, jnp.float32),
                  A=jnp.asarray(-rng.uniform(0.3, 2.0, size=HEADS), jnp.float32),
                  B=bf(rng.normal(size=(num_tokens, num_groups, N)) * 0.3),
                  C=bf(rng.normal(size=(num_tokens, num_groups, N)) * 0.3),
                  D=jnp.asarray(rng.normal(size=HEADS), jnp.float32),
                  dt_bias=jnp.asarray(rng.normal(size=HEADS) * 0.5, jnp.float32),
                  initial_state=jnp.asarray(state if layout == "vk" else state.swapaxes(-1, -2), jnp.float32),
                  cu_seqlens=cu_seqlens, state_layout=layout)
    if gate:
        z = rng.normal(size=(num_tokens, HEADS, P))
        z[cu_seqlens[-1]:] = np.nan  # also the rows past the last row's partial chunk in its z tile
        inputs["z"] = bf(z)
    return inputs


def check_against_reference(outputs, inputs, ckpt):
    y, final, states = outputs
    y_ref, final_ref, states_ref = reference.ssd(**inputs, **ckpt)
    valid = inputs["cu_seqlens"][-1]
    assert y.dtype == jnp.bfloat16 and final.dtype == states.dtype == jnp.float32
    assert rel_rms(y[:valid], y_ref[:valid]) <= Y_TOL
    assert rel_rms(final, final_ref) <= STATE_TOL
    real = int(ckpt["checkpoint_cu"][-1]) if ckpt else 0
    if real:
        assert rel_rms(states[:real], states_ref[:real]) <= STATE_TOL
    assert np.all(np.asarray(states[real:]) == 0)
    assert np.all(np.asarray(y[valid:], np.float32) == 0)


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")  # shown with a failure
    return np.random.default_rng(seed)


@pytest.mark.parametrize("num_groups, layout, pieces, gate", [(1, "vk", 1, False), (2, "kv", 3, False),
                                                              (2, "vk", 2, True)])
def test_varlen_with_checkpoints_matches_reference(num_groups, layout, pieces, gate):
    rng = fresh_rng()
    inputs = make_inputs(rng, NUM_TOKENS, num_groups, CU_SEQLENS, layout, gate=gate)
    ckpt = dict(checkpoint_cu=CHECKPOINT_CU, checkpoint_offsets=CHECKPOINT_OFFSETS)
    outputs = mosaic.ssd(**inputs, **ckpt, interpret=True, pieces=pieces)
    check_against_reference(outputs, inputs, ckpt)
    # the empty rows return their initial states
    np.testing.assert_array_equal(np.asarray(outputs[1])[[0, 3]], np.asarray(inputs["initial_state"])[[0, 3]])

    y, final, states = mosaic.ssd(**inputs, interpret=True, pieces=pieces)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(outputs[0], np.float32))
    np.testing.assert_array_equal(np.asarray(final), np.asarray(outputs[1]))
    assert states.shape == (0,) + final.shape[1:]


def test_rows_on_the_chunk_grid_with_the_split_and_traced_metadata():
    """Full chunks only (every output leaves by whole-chunk TMA stores), z and a per-channel D, the split into 2
    pieces, traced metadata against concrete metadata."""
    rng = fresh_rng()
    cu = np.array([0, 128, 384], np.int32)
    inputs = make_inputs(rng, 384, 1, cu)
    inputs["z"] = jnp.asarray(rng.normal(size=(384, HEADS, P)), jnp.bfloat16)
    inputs["D"] = jnp.asarray(rng.normal(size=(HEADS, P)), jnp.float32)  # per channel, added in the kernel
    ckpt = dict(checkpoint_cu=np.array([0, 1, 3], np.int32), checkpoint_offsets=np.array([100, 64, 200], np.int32))
    split = mosaic.ssd(**inputs, **ckpt, interpret=True, pieces=2)
    check_against_reference(split, inputs, ckpt)
    traced = jax.jit(lambda cu_seqlens: mosaic.ssd(**{**inputs, "cu_seqlens": cu_seqlens}, **ckpt, interpret=True,
                                                   pieces=1))(jnp.asarray(cu))
    np.testing.assert_allclose(np.asarray(split[0], np.float32), np.asarray(traced[0], np.float32), atol=2e-2)
    for a, b in zip(split[1:], traced[1:]):
        assert rel_rms(a, b) <= STATE_TOL


@pytest.mark.parametrize("stages", [2, 3])
def test_gate_tiles_refill_at_any_ring_depth(stages):
    """z's two tiles, outside the TMA ring, take chunk i + 2 once the consumers free chunk i, whatever the ring's
    depth: lanes of 0 to 4 chunks (rows of 1, 130 and 400 tokens in 2 pieces), partial last chunks with NaN z past
    the last row."""
    rng = fresh_rng()
    cu = np.array([0, 1, 131, 531], np.int32)
    inputs = make_inputs(rng, 536, 1, cu, gate=True)
    check_against_reference(mosaic.ssd(**inputs, interpret=True, pieces=2, stages=stages), inputs, {})


def test_the_gate_rounds_y_once():
    """y * silu(z) in fp32 before y is rounded: against float64, one bf16 rounding (rel-RMS ~1.7e-3), where gating
    the kernel's rounded y and rounding again (the former XLA pass) adds a second (~2.4e-3). A large per-channel D
    makes D x dominate y, so the roundings, not the 16-bit products, set the error."""
    rng = fresh_rng()
    inputs = make_inputs(rng, NUM_TOKENS, 1, CU_SEQLENS, gate=True)
    inputs["D"] = jnp.asarray(rng.uniform(2.0, 4.0, size=(HEADS, P)), jnp.float32)
    valid = CU_SEQLENS[-1]
    expected = np.asarray(reference.ssd(**inputs)[0])[:valid]
    fused = np.asarray(mosaic.ssd(**inputs, interpret=True, pieces=1)[0], np.float64)[:valid]
    plain = np.asarray(mosaic.ssd(**{**inputs, "z": None}, interpret=True, pieces=1)[0], np.float32)[:valid]
    z = np.asarray(inputs["z"], np.float32)[:valid]
    unfused = np.asarray(jnp.asarray(plain * z / (1 + np.exp(-z)), jnp.bfloat16), np.float64)
    fused_error, unfused_error = rel_rms(fused, expected), rel_rms(unfused, expected)
    print(f"y * silu(z) rel-RMS: fused {fused_error:.2e}, gated after rounding {unfused_error:.2e}")
    assert fused_error < 0.8 * unfused_error


def test_choose_pieces():
    assert mosaic.choose_pieces(1, 128, 64, 8192, num_sms=132) == 1
    assert mosaic.choose_pieces(1, 32, 64, 32768, num_sms=132) == 4
    assert mosaic.choose_pieces(1, 16, 128, 8192, num_sms=132) == 4
    assert mosaic.choose_pieces(1, 16, 64, 1024, num_sms=132) == 2  # >= 8 chunks per piece


def test_supports_names_the_reason():
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, 64, 1, np.array([0, 64], np.int32))
    call = dict(x=inputs["x"], dt=inputs["dt"], B=inputs["B"], C=inputs["C"])
    assert mosaic.supports(**call, interpret=True) is None
    assert mosaic.supports(**call) is not None  # no Hopper GPU here
    assert "chunk_size" in mosaic.supports(**call, chunk_size=32, interpret=True)
    assert "unknown" in mosaic.supports(**call, state_block_p=16, interpret=True)
    assert "pieces" in mosaic.supports(**call, pieces=0, interpret=True)
    many_rows = np.zeros(8193, np.int32)  # 8192 rows x 8 pieces + 1 lanes: past the grid's z axis
    assert mosaic.supports(**call, cu_seqlens=many_rows, interpret=True).startswith("cu_seqlens:")
    assert mosaic.supports(**call, cu_seqlens=many_rows, pieces=1, interpret=True) is None
    assert mosaic.supports(**{**call, "x": call["x"][..., :32]}, interpret=True).startswith("P:")
    assert "16-bit" in mosaic.supports(**{**call, "x": call["x"].astype(jnp.float32)}, interpret=True)
    assert mosaic.supports(**call, z=call["x"], interpret=True) is None
    assert mosaic.supports(**call, z=call["x"].astype(jnp.float32), interpret=True).startswith("z:")
    assert mosaic.supports(**call, z=call["x"][:, :1], interpret=True).startswith("z:")
    with pytest.raises(ValueError, match="16-bit"):
        mosaic.ssd(**{**inputs, "x": inputs["x"].astype(jnp.float32)}, interpret=True)


# z's two tiles sit outside the TMA ring: the ring keeps its 4 slots at N = 128 with z too
@pytest.mark.parametrize("head_p, head_n, gate, stages", [(128, 64, False, 4), (128, 128, False, 4), (64, 64, True, 4),
                                                          (128, 64, True, 4), (64, 128, True, 4), (128, 128, True, 4)])
def test_lowers_for_sm90(monkeypatch, head_p, head_n, gate, stages):
    """Both kernels (with checkpoints, D, z, and the split's state-only pass) lower for Hopper within the SMEM
    budget."""
    from jax.experimental.mosaic.gpu import core as mosaic_core  # private: the kernel's SMEM bytes at launch

    sizes = []
    tree_size = mosaic_core._smem_tree_size
    monkeypatch.setattr(mosaic_core, "_smem_tree_size", lambda tree: sizes.append(tree_size(tree)) or sizes[-1])
    monkeypatch.setattr(device, "is_hopper", lambda: True)
    T, H = 256, 4
    spec = jax.ShapeDtypeStruct
    bf = jnp.bfloat16

    def call(x, dt, A, B, C, z, h0, cu, ccu, off):
        return mosaic.ssd(x, dt, A, B, C, D=jnp.ones(H), z=z, initial_state=h0, cu_seqlens=cu, checkpoint_cu=ccu,
                          checkpoint_offsets=off, pieces=2)

    args = (spec((T, H, head_p), bf), spec((T, H), jnp.float32), spec((H,), jnp.float32), spec((T, 1, head_n), bf),
            spec((T, 1, head_n), bf), spec((T, H, head_p), bf) if gate else None,
            spec((1, H, head_p, head_n), jnp.float32), spec((2,), jnp.int32), spec((2,), jnp.int32),
            spec((1,), jnp.int32))
    text = jax.export.export(jax.jit(call), platforms=["cuda"])(*args).mlir_module()
    assert "ssd_lanes" in text and "ssd_lanes_states" in text
    assert sizes and max(sizes) <= 227 * 1024, sizes
    assert mosaic._stages(head_n, bf, has_output=True, has_z=gate) == stages


def test_no_tokens_and_the_public_entry():
    from jaxckpt import ops

    rng = fresh_rng()
    empty = make_inputs(rng, 0, 1, np.array([0, 0], np.int32))
    y, final, _ = ops.ssd(**empty, config=ops.SsdPallasMosaicGpuConfig(interpret=True))
    assert y.shape == (0, HEADS, P)
    np.testing.assert_array_equal(np.asarray(final), np.asarray(empty["initial_state"]))
