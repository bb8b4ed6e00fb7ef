"""The hybrid model over paged caches: checkpoints leave logits alone, a request resumed from a checkpoint slot and
its KV pages matches the uncached full forward, the bench config builds, and bad steps raise ValueError.

The compiled model runs in one test on one shape bucket (jit compile time dominates on CPU); the others need shapes
only."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxckpt.layers import StepMetadata, pack_tokens
from jaxckpt.models import HybridConfig, HybridModel, forward

NUM_PAGES = 32
NUM_SLOTS = 8
BUCKET = dict(num_kv_pages=NUM_PAGES, num_state_slots=NUM_SLOTS, num_tokens=64, num_rows=4, num_checkpoints=4,
              max_blocks=8)


@functools.cache
def _model():
    model = HybridModel(HybridConfig.tiny(), rngs=nnx.Rngs(7))
    return model, *nnx.split(model)


@functools.cache
def _abstract_model():
    """Shapes only: enough for host-side validation, parameter names and cache layouts, at no init cost."""
    model = nnx.eval_shape(lambda: HybridModel(HybridConfig.tiny(), rngs=nnx.Rngs(7)))
    return model, *nnx.split(model)


def _step(caches, token_rows, **meta_args):
    model, graphdef, state = _model()
    config = model.config
    meta = StepMetadata.build([len(r) for r in token_rows], block_size=config.block_size,
                              max_model_len=config.max_model_len, **BUCKET, **meta_args)
    return forward(graphdef, state, pack_tokens(token_rows, meta.num_tokens), meta, caches)


def _assert_rel_close(actual, expected, rel=1e-4):
    actual, expected = np.asarray(actual), np.asarray(expected)
    err = np.abs(actual - expected).max() / np.abs(expected).max()
    assert err <= rel, f"relative error {err:.2e} > {rel:.0e}"


def test_resume_from_checkpoint_matches_uncached_forward():
    model, _, _ = _model()
    rng = np.random.default_rng(12)
    first = rng.integers(0, 256, 38)
    # shares 16 tokens (2 pages of 8) with `first`, then a decode token; as long as `first`, so the eager
    # reference runs one shape
    second = np.concatenate([first[:16], rng.integers(0, 256, 22)])
    third = first[:12]
    reference_first, reference_second = model.reference_logits(first), model.reference_logits(second)

    args = dict(context_lens=[0], block_tables=[[1, 2, 3, 4, 5]], initial_state_indices=[0], final_state_indices=[1])
    plain, _ = _step(model.init_caches(NUM_PAGES, NUM_SLOTS, fill=np.nan), [first], **args)
    logits, caches = _step(model.init_caches(NUM_PAGES, NUM_SLOTS, fill=np.nan), [first], checkpoint_cu=[0, 2],
                           checkpoint_offsets=[16, 30], checkpoint_state_indices=[2, 5], **args)
    np.testing.assert_array_equal(np.asarray(logits)[0], np.asarray(plain)[0])
    _assert_rel_close(logits[0], reference_first[-1])
    for layer_type, pools in zip(caches.layer_types, caches.layers):
        if layer_type != "attention":
            for pool in pools:
                written = np.isin(np.arange(NUM_SLOTS), [1, 2, 5])
                finite = np.isfinite(np.asarray(pool)).reshape(NUM_SLOTS, -1)
                assert finite[written].all() and not finite[~written].any()

    # the prefix-cache hit: state slot 2 and the first two KV pages of `first`, then only the new tokens
    logits, caches = _step(caches, [second[16:37]], context_lens=[16], block_tables=[[1, 2, 6, 7, 8]],
                           initial_state_indices=[2], final_state_indices=[3])
    _assert_rel_close(logits[0], reference_second[36])
    # one engine step: a decode row of `second` (decode rows first) and a fresh prefill row
    logits, caches = _step(caches, [second[37:], third], context_lens=[37, 0],
                           block_tables=[[1, 2, 6, 7, 8], [9, 10]], initial_state_indices=[3, 0],
                           final_state_indices=[3, 4], num_decodes=1)
    _assert_rel_close(logits[0], reference_second[-1])
    _assert_rel_close(logits[1], reference_first[11])


def test_param_names_and_alignment():
    model, _, state = _abstract_model()
    names = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert {"embed_tokens.weight", "norm.weight", "lm_head.weight", "layers.0.mixer.in_proj_qkvz.weight",
            "layers.1.mixer.A_log", "layers.2.mixer.q_proj.weight", "layers.3.mixer.f_b_proj.weight",
            "layers.3.mlp.down_proj.weight", "layers.0.input_layernorm.weight"} <= names
    assert model.checkpoint_alignment() == 1


def test_bench_config_builds():
    config = HybridConfig.bench()
    model = nnx.eval_shape(lambda: HybridModel(config, rngs=nnx.Rngs(0)))
    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    assert all(leaf.dtype == np.dtype("bfloat16") for leaf in leaves if leaf.ndim == 2)
    assert 0.5e9 < sum(leaf.size for leaf in leaves) < 2e9
    caches = jax.eval_shape(lambda: model.init_caches(64, 4))
    gdn_conv, gdn_state = caches.layers[0]
    assert gdn_conv.shape == (4, 2 * 16 * 128 + 32 * 128, 3) and gdn_state.shape == (4, 32, 128, 128)
    assert gdn_state.dtype == np.float32
    assert caches.layers[3][0].shape == (64, config.block_size, config.num_kv_heads, config.head_dim)


def test_bad_steps_raise_value_errors():
    model, graphdef, state = _abstract_model()
    config = model.config
    base = dict(context_lens=[0], block_tables=[list(range(1, 9))], initial_state_indices=[0],
                final_state_indices=[1], block_size=config.block_size, max_model_len=config.max_model_len, **BUCKET)
    with pytest.raises(ValueError, match="^query_lens: row 0 reaches 300"):
        StepMetadata.build([300], **base | dict(block_tables=[list(range(1, 40))], num_kv_pages=64,
                                                num_tokens=512, max_blocks=64))
    with pytest.raises(ValueError, match="^query_lens: empty batch"):
        StepMetadata.build([], **base | dict(context_lens=[], block_tables=[], initial_state_indices=[],
                                             final_state_indices=[]))
    with pytest.raises(ValueError, match="^checkpoint_state_indices: slot 8 is outside"):
        StepMetadata.build([20], checkpoint_cu=[0, 1], checkpoint_offsets=[8], checkpoint_state_indices=[8], **base)
    with pytest.raises(ValueError, match="^checkpoint_offsets: row 0"):
        StepMetadata.build([20], checkpoint_cu=[0, 1], checkpoint_offsets=[20], checkpoint_state_indices=[2], **base)
    with pytest.raises(ValueError, match="^block_tables: row 0 holds 70 tokens"):
        StepMetadata.build([30], **base | dict(context_lens=[40], initial_state_indices=[2], max_blocks=16))
    with pytest.raises(ValueError, match="^num_state_slots: .* at least 2"):
        model.init_caches(NUM_PAGES, 1)
    # caches smaller than the engine's slot and page tables: caught before the device silently clamps indices
    meta = StepMetadata.build([5], **base | dict(final_state_indices=[7]))
    small = model.init_caches(NUM_PAGES, 4)
    with pytest.raises(ValueError, match="^final_state_indices: slot 7 is outside"):
        forward(graphdef, state, pack_tokens([[1] * 5], meta.num_tokens), meta, small)
    with pytest.raises(ValueError, match="^tokens: expected"):
        forward(graphdef, state, np.zeros(3, np.int32), meta, model.init_caches(NUM_PAGES, NUM_SLOTS))
