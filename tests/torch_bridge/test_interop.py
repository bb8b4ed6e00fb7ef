"""The DLPack bridge: exact round trips, paged calls through JAX equal jaxckpt's own paged calls, untouched slots."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from jaxckpt import ops  # noqa: E402
from jaxckpt.plan.conventions import NULL_SLOT, PAD_CHECKPOINT_OFFSET, map_vllm_slots  # noqa: E402
from torch_bridge import interop  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_round_trip_is_exact(dtype):
    gen = torch.Generator().manual_seed(501)
    source = (torch.randn(5, 3, 7, generator=gen) * 100).to(dtype)
    array = interop.to_jax(source)
    assert array.shape == source.shape and array.dtype == jnp.dtype(str(dtype).removeprefix("torch."))
    assert np.array_equal(np.asarray(array.astype(jnp.float32)), source.float().numpy())
    back = interop.to_torch(array * 1 if dtype != torch.bool else ~array)
    assert back.dtype == dtype
    assert torch.equal(back, source if dtype != torch.bool else ~source)


def test_non_contiguous_tensors_are_refused():
    with pytest.raises(ValueError, match="^x: must be contiguous"):
        interop.to_jax(torch.zeros(4, 6)[:, ::2], name="x")
    with pytest.raises(ValueError, match="^x: expected a torch.Tensor"):
        interop.to_jax(np.zeros(3), name="x")


def delta_problem(rng, lengths, *, heads=2, v_heads=4, dim=8, pad=2):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    num_tokens = int(cu[-1]) + pad
    k = rng.standard_normal((num_tokens, heads, dim))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    arrays = dict(q=rng.standard_normal((num_tokens, heads, dim)), k=k,
                  v=rng.standard_normal((num_tokens, v_heads, dim)),
                  g=-np.abs(rng.standard_normal((num_tokens, v_heads))) * 0.2,
                  beta=rng.uniform(0.1, 0.9, (num_tokens, v_heads)))
    return {name: a.astype(np.float32) for name, a in arrays.items()}, cu


def test_paged_gdn_through_the_bridge_equals_jaxckpt_paged():
    rng = np.random.default_rng(502)
    arrays, cu = delta_problem(rng, [70, 5, 0, 33])
    num_slots = 12
    pool = np.full((num_slots, 4, 8, 8), np.nan, np.float32)
    pool[3], pool[6], pool[9] = (rng.standard_normal((3, 4, 8, 8)) * 0.3).astype(np.float32)
    initial = np.array([3, 6, -1, 9])
    has_initial = np.array([True, False, True, True])
    final = np.array([3, 4, -1, 10])
    ccu = np.array([0, 2, 3, 3, 4], np.int32)
    offsets = np.array([1, 64, 4, 32, PAD_CHECKPOINT_OFFSET], np.int32)
    ckpt_slots = np.array([5, 7, -1, 11, NULL_SLOT])
    options = dict(cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets, implementation="xla")

    torch_pool = torch.tensor(pool)
    o = interop.gated_delta_rule_paged(*(torch.tensor(arrays[n]) for n in ("q", "k", "v", "g", "beta")), torch_pool,
                                       initial_state_indices=torch.tensor(initial), has_initial_state=has_initial,
                                       final_state_indices=final, checkpoint_state_indices=ckpt_slots, **options)
    jax_o, jax_pool = ops.gated_delta_rule_paged(
        *(jnp.asarray(arrays[n]) for n in ("q", "k", "v", "g", "beta")), jnp.asarray(pool),
        initial_state_indices=map_vllm_slots(initial), has_initial_state=has_initial,
        final_state_indices=map_vllm_slots(final), checkpoint_state_indices=map_vllm_slots(ckpt_slots), donate=False,
        **options)
    assert isinstance(o, torch.Tensor) and o.shape == (int(cu[-1]) + 2, 4, 8)
    np.testing.assert_allclose(o[:int(cu[-1])].numpy(), np.asarray(jax_o)[:int(cu[-1])], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(torch_pool.numpy(), np.asarray(jax_pool), rtol=1e-6, atol=1e-6)
    untouched = [0, 1, 2, 8]
    assert torch.isnan(torch_pool[untouched]).all()
    assert torch.equal(torch_pool[6], torch.tensor(pool[6])) and torch.equal(torch_pool[9], torch.tensor(pool[9]))
    for slot in (3, 4, 5, 7, 10, 11):
        assert torch.isfinite(torch_pool[slot]).all(), slot


def test_conv1d_paged_bf16_pool_and_dense_wrapper():
    rng = np.random.default_rng(503)
    cu = np.array([0, 9, 12], np.int32)
    x = torch.tensor(rng.standard_normal((12, 6)), dtype=torch.bfloat16)
    weight = torch.tensor(rng.standard_normal((6, 4)), dtype=torch.float32)
    pool = torch.full((5, 6, 3), float("nan"), dtype=torch.bfloat16)
    pool[2] = torch.tensor(rng.standard_normal((6, 3)), dtype=torch.bfloat16)
    options = dict(cu_seqlens=cu, checkpoint_cu=np.array([0, 2, 2]), checkpoint_offsets=np.array([1, 5]),
                   implementation="xla")
    initial = torch.stack([pool[2].float(), torch.zeros(6, 3)])
    y, final, ckpt = interop.causal_conv1d(x, weight, initial_state=initial, **options)
    before = pool.clone()
    y_paged = interop.causal_conv1d_paged(x, weight, pool, initial_state_indices=[2, -1],
                                          has_initial_state=np.array([True, False]), final_state_indices=[2, 3],
                                          checkpoint_state_indices=[1, 4], **options)
    assert torch.equal(y_paged, y)
    # conv states are copies of raw inputs: bit-exact in the pool's dtype
    assert torch.equal(pool[2], x[6:9].T) and torch.equal(pool[3], x[9:12].T)
    assert torch.equal(pool[1], torch.cat([before[2][:, 1:], x[:1].T], 1))
    assert torch.equal(pool[4], x[2:5].T) and torch.equal(pool[[1, 2, 3, 4]].float(), torch.stack(
        [ckpt[0], final[0], final[1], ckpt[1]]).to(torch.bfloat16).float())
    assert torch.isnan(pool[0].float()).all()


def test_bad_slots_and_devices_raise_before_anything_runs():
    rng = np.random.default_rng(504)
    arrays, cu = delta_problem(rng, [6, 4])
    args = [torch.tensor(arrays[n]) for n in ("q", "k", "v", "g", "beta")]
    pool = torch.full((4, 4, 8, 8), float("nan"))
    base = dict(cu_seqlens=cu, initial_state_indices=[1, 2], has_initial_state=np.array([True, True]),
                final_state_indices=[1, 2], implementation="xla")
    for name, change in (("initial_state_indices", dict(initial_state_indices=[1, 4])),
                         ("final_state_indices", dict(final_state_indices=[-2, 1])),
                         ("final_state_indices/checkpoint_state_indices", dict(final_state_indices=[3, 3])),
                         ("has_initial_state", dict(has_initial_state=np.array([1, 1]))),
                         ("initial_state_indices", dict(initial_state_indices=[1]))):
        with pytest.raises(ValueError, match=f"^{name}"):
            interop.gated_delta_rule_paged(*args, pool, **{**base, **change})
    with pytest.raises(ValueError, match="^state_pool"):
        interop.gated_delta_rule_paged(*args, pool[:, :2], **base)
    with pytest.raises(ValueError, match="^v: on meta"):
        interop.gated_delta_rule_paged(*args[:2], args[2].to("meta"), *args[3:], pool, **base)
    assert torch.isnan(pool).all()


def test_share_gpu_with_jax_sets_the_flag_and_warns_once_jax_started(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    assert interop.share_gpu_with_jax() is True
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")  # an explicit choice is kept
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    with pytest.warns(UserWarning, match="already started"):
        assert interop.share_gpu_with_jax() is False
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"

