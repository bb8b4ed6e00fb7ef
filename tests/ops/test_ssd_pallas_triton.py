"""The Pallas Triton SSD kernels, run in interpret mode on CPU, against the float64 token-by-token reference;
checkpoints leave outputs and final states bitwise unchanged; unsupported calls name their reason.

Interpret mode evaluates every dot in fp32, so fp32 inputs land at rel-RMS ~1e-7 against the float64 reference;
FP32_TOL leaves two orders of magnitude of room.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt import ops
from jaxckpt.ops.ssd import pallas_triton, reference
from tests.numerics import rel_rms

pytestmark = pytest.mark.interpret

FP32_TOL = 1e-5
CHUNK = 16
HEADS, DIM = 2, 16

# rows of lengths 0, 1, 36, 0, 43 and 10 padding tokens; checkpoints at 1, a chunk boundary (16), inside chunks and
# len - 1, then two padded CSR entries
CU_SEQLENS = np.array([0, 0, 1, 37, 37, 80], np.int32)
NUM_TOKENS = 90
CHECKPOINT_CU = np.array([0, 0, 0, 3, 3, 6], np.int32)
CHECKPOINT_OFFSETS = np.array([1, 16, 35, 1, 21, 42, 0, 0], np.int32)
ROWS_WITH_STATE = (0, 2, 4)


def make_inputs(rng, num_groups):
    T = NUM_TOKENS
    return dict(x=rng.normal(size=(T, HEADS, DIM)).astype(np.float32),
                # a few large dt: strong decays that overflow exp(Acs_i - Acs_j) above the diagonal unless masked
                dt=(rng.normal(size=(T, HEADS)) + np.where(rng.random((T, HEADS)) < 0.05, 3.0, 0.0))
                .astype(np.float32),
                A=-rng.uniform(0.3, 2.0, size=HEADS).astype(np.float32),
                B=rng.normal(size=(T, num_groups, DIM)).astype(np.float32),
                C=rng.normal(size=(T, num_groups, DIM)).astype(np.float32))


def make_options(rng, layout):
    num_rows = CU_SEQLENS.size - 1
    state = rng.normal(size=(num_rows, HEADS, DIM, DIM)).astype(np.float32)
    state[[n for n in range(num_rows) if n not in ROWS_WITH_STATE]] = 0.0
    return dict(D=rng.normal(size=(HEADS, DIM)).astype(np.float32),
                dt_bias=rng.normal(size=HEADS).astype(np.float32),
                z=rng.normal(size=(NUM_TOKENS, HEADS, DIM)).astype(np.float32),
                dt_limit=(0.01, 4.0), initial_state=state, cu_seqlens=CU_SEQLENS, state_layout=layout)


# state_block_p 4: the state pass splits P over four programs per row and head
@pytest.mark.parametrize("num_groups, layout, seed, state_block_p", [(1, "vk", 1, 16), (2, "kv", 2, 4)])
def test_matches_reference_varlen_with_checkpoints(num_groups, layout, seed, state_block_p):
    rng = np.random.default_rng(seed)
    inputs = make_inputs(rng, num_groups)
    options = make_options(rng, layout)
    tuning = dict(state_block_p=state_block_p)
    ckpt = dict(checkpoint_cu=CHECKPOINT_CU, checkpoint_offsets=CHECKPOINT_OFFSETS)
    y, final, states = pallas_triton.ssd(**inputs, **options, **ckpt, chunk_size=CHUNK, interpret=True, **tuning)
    y_ref, final_ref, states_ref = reference.ssd(**inputs, **options, **ckpt)
    assert y.dtype == jnp.float32 and final.dtype == states.dtype == jnp.float32
    assert final.shape == final_ref.shape and states.shape == states_ref.shape
    assert rel_rms(y, y_ref) <= FP32_TOL
    assert rel_rms(final, final_ref) <= FP32_TOL
    valid = CHECKPOINT_CU[-1]
    assert rel_rms(states[:valid], states_ref[:valid]) <= FP32_TOL
    np.testing.assert_array_equal(np.asarray(y)[CU_SEQLENS[-1]:], 0)
    # the empty rows return their initial states
    np.testing.assert_array_equal(np.asarray(final)[[0, 3]], options["initial_state"][[0, 3]])

    plain_y, plain_final, plain_states = pallas_triton.ssd(**inputs, **options, chunk_size=CHUNK, interpret=True,
                                                           **tuning)
    np.testing.assert_array_equal(np.asarray(plain_y), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(plain_final), np.asarray(final))
    assert plain_states.shape == (0,) + final.shape[1:]


def test_supports_names_the_reason():
    x = jnp.zeros((8, 2, 16), jnp.float32)
    dt = jnp.zeros((8, 2), jnp.float32)
    B = jnp.zeros((8, 1, 16), jnp.float32)
    assert pallas_triton.supports(x, dt, B, B, chunk_size=16, interpret=True) is None
    assert pallas_triton.supports(jnp.zeros((8, 2, 24)), dt, B, B, interpret=True).startswith("P:")
    assert pallas_triton.supports(x, dt, jnp.zeros((8, 1, 512)), B, interpret=True).startswith("N:")
    assert pallas_triton.supports(x, dt, B, B, chunk_size=128, interpret=True).startswith("chunk_size:")
    assert pallas_triton.supports(x, dt, B, B, interpret=True, block_q=32).startswith("tuning:")
    assert pallas_triton.supports(x, dt, B, B, interpret=True, state_block_p=6).startswith("state_block_p:")
    assert pallas_triton.supports(x, dt, B, B, chunk_size=16, interpret=True, state_block_p=64) is None
    reason = pallas_triton.supports(x, dt, B, B)
    assert reason is None or reason.startswith("backend:")


def test_through_the_public_entry_with_fallback_reasons():
    from jaxckpt.ops.common.api import choose_implementation
    from jaxckpt.ops.ssd.api import REGISTRY

    rng = np.random.default_rng(21)
    T, H, G, P, N = 40, 2, 1, 16, 16
    x = rng.standard_normal((T, H, P)).astype(np.float32)
    dt = rng.standard_normal((T, H)).astype(np.float32) - 1
    A = -rng.uniform(0.5, 2.0, H).astype(np.float32)
    B = rng.standard_normal((T, G, N)).astype(np.float32)
    C = rng.standard_normal((T, G, N)).astype(np.float32)
    z = rng.standard_normal((T, H, P)).astype(np.float32)
    meta = dict(cu_seqlens=np.array([0, 1, 40]), checkpoint_cu=np.array([0, 0, 1]), checkpoint_offsets=np.array([17]),
                z=z)
    expected = ops.ssd(x, dt, A, B, C, **meta, implementation="reference")
    got = ops.ssd(x, dt, A, B, C, **meta, implementation="pallas_triton", num_decodes=1, chunk_size=16,
                  config=ops.SsdPallasTritonConfig(interpret=True))
    for a, b in zip(got, expected):
        assert np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b) < 1e-5
    choice = choose_implementation(REGISTRY, None, x=x, dt=dt, B=B, C=C, chunk_size=16)
    assert choice.name == "xla" and [name for name, _ in choice.declined] == ["pallas_mosaic_gpu", "pallas_triton"]
