"""Layers over packed rows and paged pools: packing, step splits, checkpoints, decode, poisoned slots, param I/O.

Every layer runs under one jitted step per (layer, num_decodes) on a fixed shape bucket, so the file compiles few
programs; the float64 `reference` path of each layer is the independent oracle.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxckpt.layers import (Attention, GatedDeltaNet, KimiDeltaAttention, Mamba2Mixer, StepMetadata, load_params,
                            param_dict, state_pools)

D_MODEL = 32
NUM_SLOTS = 12
NUM_PAGES = 24
BLOCK = 8
BUCKET = dict(block_size=BLOCK, num_kv_pages=NUM_PAGES, num_state_slots=NUM_SLOTS, num_tokens=64, num_rows=4,
              num_checkpoints=4, max_blocks=8)
RECURRENT = ("mamba2", "gdn", "kda")
KINDS = (*RECURRENT, "attention")
ATOL = 2e-5


def _make(kind, seed):
    rngs = nnx.Rngs(seed)
    common = dict(chunk_size=16, implementation="xla", rngs=rngs)
    if kind == "mamba2":
        return Mamba2Mixer(D_MODEL, num_heads=4, head_dim=16, d_state=16, **common)
    if kind == "gdn":
        return GatedDeltaNet(D_MODEL, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, **common)
    if kind == "kda":
        return KimiDeltaAttention(D_MODEL, num_heads=2, head_dim=16, **common)
    return Attention(D_MODEL, num_heads=4, num_kv_heads=2, head_dim=16, block_size=BLOCK, rngs=rngs)


@functools.cache
def _layer(kind):
    layer = _make(kind, seed=KINDS.index(kind))
    graphdef, state = nnx.split(layer)
    step = jax.jit(lambda x, meta, pools: nnx.merge(graphdef, state)(x, meta, pools))
    return layer, step


def _pools(kind):
    layer, _ = _layer(kind)
    if kind == "attention":
        return tuple(jnp.full((NUM_PAGES, *layer.page_shape), np.nan, jnp.float32) for _ in range(2))
    return state_pools(layer.state_shapes, NUM_SLOTS, fill=np.nan)


def _run(kind, x_rows, *, context_lens=None, initial=None, final, pages, pools=None, checkpoints=None,
         num_decodes=0):
    """One step over rows x_rows (list of [L, d_model]); checkpoints: per row a list of (offset, slot)."""
    _, step = _layer(kind)
    n = len(x_rows)
    context_lens = [0] * n if context_lens is None else context_lens
    initial = [0] * n if initial is None else initial
    ckpt = [[] for _ in range(n)] if checkpoints is None else checkpoints
    meta = StepMetadata.build(
        [len(x) for x in x_rows], context_lens=context_lens, block_tables=pages, initial_state_indices=initial,
        final_state_indices=final, checkpoint_cu=np.cumsum([0] + [len(c) for c in ckpt]),
        checkpoint_offsets=[p for c in ckpt for p, _ in c], checkpoint_state_indices=[s for c in ckpt for _, s in c],
        num_decodes=num_decodes, **BUCKET)
    x = np.zeros((meta.num_tokens, D_MODEL), np.float32)
    x[:sum(len(r) for r in x_rows)] = np.concatenate(x_rows)
    out, pools = step(jnp.asarray(x), meta, _pools(kind) if pools is None else pools)
    cu = meta.cu_seqlens
    return [np.asarray(out[cu[i]:cu[i + 1]]) for i in range(n)], pools


def _rows(rng, *lens):
    return [rng.normal(size=(n, D_MODEL)).astype(np.float32) for n in lens]


def _pages(*counts, start=1):
    firsts = np.cumsum([start, *counts])
    return [list(range(a, a + c)) for a, c in zip(firsts, counts)]


@pytest.mark.parametrize("kind", KINDS)
def test_packed_rows_equal_rows_alone(kind):
    rng = np.random.default_rng(100 + KINDS.index(kind))
    rows = _rows(rng, 21, 7, 30)
    pages = _pages(3, 1, 4)
    packed, pools = _run(kind, rows, final=[1, 2, 3], pages=pages)
    for i, x in enumerate(rows):
        alone, alone_pools = _run(kind, [x], final=[i + 1], pages=[pages[i]])
        np.testing.assert_allclose(packed[i], alone[0], atol=ATOL, rtol=0)
        if kind != "attention":
            for pool, alone_pool in zip(pools, alone_pools):
                np.testing.assert_allclose(pool[i + 1], alone_pool[i + 1], atol=ATOL, rtol=0)
    # poisoned pools: exactly the slots (or page entries) this step owns were written
    if kind == "attention":
        written = np.zeros(pools[0].shape[:2], bool)  # [pages, block_size]
        for x, row_pages in zip(rows, pages):
            positions = np.arange(len(x))
            written[np.asarray(row_pages)[positions // BLOCK], positions % BLOCK] = True
    else:
        written = np.isin(np.arange(NUM_SLOTS), [1, 2, 3])
    for pool in pools:
        finite = np.isfinite(np.asarray(pool)).reshape(*written.shape, -1)
        assert finite[written].all() and not finite[~written].any()


@pytest.mark.parametrize("kind", KINDS)
def test_two_step_prefill_equals_one_step(kind):
    rng = np.random.default_rng(200 + KINDS.index(kind))
    (x,) = _rows(rng, 45)
    pages = _pages(6)
    (whole,), whole_pools = _run(kind, [x], final=[1], pages=pages)
    (head,), pools = _run(kind, [x[:19]], final=[2], pages=pages)
    (tail,), pools = _run(kind, [x[19:]], context_lens=[19], initial=[2], final=[3], pages=pages, pools=pools,
                          checkpoints=[[(2, 4)]])
    np.testing.assert_allclose(np.concatenate([head, tail]), whole, atol=ATOL, rtol=0)
    layer, _ = _layer(kind)
    np.testing.assert_allclose(whole, np.asarray(layer.reference(jnp.asarray(x))), atol=ATOL, rtol=0)
    if kind == "attention":
        return
    # the checkpoint 2 tokens into the second step mixes the incoming conv window with new inputs
    _, prefix_pools = _run(kind, [x[:21]], final=[5], pages=pages)
    for pool, whole_pool, prefix_pool in zip(pools, whole_pools, prefix_pools):
        np.testing.assert_allclose(pool[3], whole_pool[1], atol=ATOL, rtol=0)
        np.testing.assert_allclose(pool[4], prefix_pool[5], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(pools[0][4], prefix_pools[0][5])


@pytest.mark.parametrize("kind", RECURRENT)
def test_checkpoints_equal_final_states_of_prefixes(kind):
    rng = np.random.default_rng(300 + KINDS.index(kind))
    rows = _rows(rng, 38, 25)
    pages = _pages(5, 4)
    checkpoints = [[(9, 3), (16, 4), (33, 5)], [(5, 6)]]
    outs, pools = _run(kind, rows, final=[1, 2], pages=pages, checkpoints=checkpoints)
    plain, _ = _run(kind, rows, final=[1, 2], pages=pages)
    for out, ref in zip(outs, plain):
        np.testing.assert_array_equal(out, ref)
    for row, row_ckpts in enumerate(checkpoints):
        for offset, slot in row_ckpts:
            _, prefix_pools = _run(kind, [rows[row][:offset]], final=[7], pages=[pages[row]])
            np.testing.assert_array_equal(pools[0][slot], prefix_pools[0][7])
            np.testing.assert_allclose(pools[1][slot], prefix_pools[1][7], atol=ATOL, rtol=0)
    for pool in pools:
        assert np.isfinite(np.asarray(pool[1:7])).all()
        assert np.isnan(np.asarray(pool[0])).all() and np.isnan(np.asarray(pool[7:])).all()


@pytest.mark.parametrize("kind", KINDS)
def test_decode_after_prefill_equals_longer_prefill(kind):
    rng = np.random.default_rng(400 + KINDS.index(kind))
    rows = _rows(rng, 20, 29)
    pages = _pages(3, 4)
    longer, longer_pools = _run(kind, rows, final=[1, 2], pages=pages)
    _, pools = _run(kind, [rows[0][:17], rows[1][:26]], final=[3, 4], pages=pages)
    for i in range(3):
        decoded, pools = _run(kind, [rows[0][17 + i:18 + i], rows[1][26 + i:27 + i]], context_lens=[17 + i, 26 + i],
                              initial=[3, 4], final=[3, 4], pages=pages, pools=pools, num_decodes=2)
        np.testing.assert_allclose(decoded[0][0], longer[0][17 + i], atol=ATOL, rtol=0)
        np.testing.assert_allclose(decoded[1][0], longer[1][26 + i], atol=ATOL, rtol=0)
    if kind != "attention":
        for pool, longer_pool in zip(pools, longer_pools):
            np.testing.assert_allclose(pool[3:5], longer_pool[1:3], atol=ATOL, rtol=0)


EXPECTED_NAMES = {
    "mamba2": {"in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
               "out_proj.weight"},
    "gdn": {"in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
            "out_proj.weight"},
    "kda": {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
            "v_conv1d.weight", "f_a_proj.weight", "f_b_proj.weight", "A_log", "dt_bias", "b_proj.weight",
            "g_a_proj.weight", "g_b_proj.weight", "o_norm.weight", "o_proj.weight"},
    "attention": {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"},
}


@pytest.mark.parametrize("kind", KINDS)
def test_params_round_trip_through_a_dict(kind):
    layer, _ = _layer(kind)
    params = param_dict(layer)
    assert set(params) == EXPECTED_NAMES[kind]
    other = _make(kind, seed=50)
    # torch checkpoints store depthwise conv weights [D, 1, W] and vLLM's KDA A_log [1, 1, H, 1]
    torch_shaped = {name: a[:, None, :] if "conv1d.weight" in name else a.reshape(1, 1, -1, 1)
                    if name == "A_log" and kind == "kda" else a for name, a in params.items()}
    load_params(other, torch_shaped)
    loaded = param_dict(other)
    for name, array in params.items():
        np.testing.assert_array_equal(loaded[name], array)
    with pytest.raises(ValueError, match="^params: missing"):
        load_params(other, {k: v for k, v in params.items() if k != "out_proj.weight" and k != "o_proj.weight"})
    with pytest.raises(ValueError, match="^params: .* has shape"):
        load_params(other, params | {name: np.zeros((3, 3)) for name in params if name.endswith("weight")})
