"""The Pallas Triton paged flash attention (interpret mode) against the plain paged attention it replaces on the GPU:
packed rows with cached context, decode rows, tiles straddling pages, NaN in every page no forward wrote."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt.layers import attention_pallas_triton
from jaxckpt.layers.attention import choose_attention, paged_attention
from tests.layers.attention_cases import paged_step
from tests.numerics import rel_rms

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("page, groups, block_q", [(16, 2, 8), (48, 4, None), (32, 1, 16)])
def test_flash_paged_attention_matches_the_plain_one(page, groups, block_q):
    rng = np.random.default_rng(page + groups)
    kv_heads, dim = 2, 16
    # two decode rows, a fresh prompt, a prompt resuming after cached context, one resuming mid-page
    query_lens, context_lens = [1, 1, 37, 20, 9], [50, 7, 0, 2 * page, page + 5]
    num_pages = 40
    meta = paged_step(rng, page=page, query_lens=query_lens, context_lens=context_lens, num_decodes=2,
                      num_pages=num_pages, num_tokens=80, num_rows=len(query_lens) + 1)
    meta = jax.tree.map(jnp.asarray, meta)
    num_tokens = meta.positions.shape[0]
    q = jnp.asarray(rng.standard_normal((num_tokens, kv_heads, groups, dim)), jnp.float32) * dim ** -0.5
    k = jnp.asarray(rng.standard_normal((num_tokens, kv_heads, dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((num_tokens, kv_heads, dim)), jnp.float32)
    # cached context: every page holds random K/V, then pages no row owns are poisoned
    pages = [jnp.asarray(rng.standard_normal((num_pages, page, kv_heads, dim)), jnp.float32) for _ in range(2)]
    owned = np.zeros(num_pages, bool)
    owned[np.asarray(meta.block_tables).ravel()] = True
    owned[0] = False
    pages = [jnp.where(jnp.asarray(owned)[:, None, None, None], p, jnp.nan) for p in pages]
    # positions past each row's end inside its last page are unwritten too
    plain, plain_pools = paged_attention(q, k, v, meta, tuple(pages), block_size=page, implementation="xla")
    fast, fast_pools = paged_attention(q, k, v, meta, tuple(pages), block_size=page, implementation="pallas_triton",
                                       interpret=True)
    real = int(meta.cu_seqlens[-1])
    assert np.isfinite(np.asarray(plain[:real])).all()
    assert rel_rms(fast[:real], plain[:real]) <= 1e-5
    assert np.all(np.asarray(fast[real:]) == 0)
    for a, b in zip(fast_pools, plain_pools):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if block_q is not None:
        # several tiles per row, a row's last tile partial
        direct = attention_pallas_triton.attend(q, *fast_pools, meta.cu_seqlens, meta.positions, meta.block_tables,
                                                block_q=block_q, interpret=True)
        assert rel_rms(direct[:real], plain[:real]) <= 1e-5


def test_the_choice_and_what_the_kernel_declines(monkeypatch):
    q = jnp.zeros((8, 2, 3, 16))
    supported = jnp.zeros((8, 2, 4, 16))
    pages = jnp.zeros((4, 16, 2, 16))
    assert choose_attention(supported, pages, pages, None) == "xla"  # off the GPU
    assert choose_attention(q, pages, pages, "pallas_triton") == "pallas_triton"
    # on a GPU the flash kernel wherever it takes the shapes, the plain path where it declines them
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert choose_attention(supported, pages, pages, None) == "pallas_triton"
    assert choose_attention(q, pages, pages, None) == "xla"
    assert choose_attention(supported, pages, jnp.zeros((4, 16, 2, 24)), None) == "xla"  # V's head dim
    assert choose_attention(supported, jnp.zeros((4, 24, 2, 16)), jnp.zeros((4, 24, 2, 16)), None) == "xla"
    assert choose_attention(supported, pages, pages, "xla") == "xla"
    assert "powers of two" in attention_pallas_triton.supports(q, pages, pages)
    assert attention_pallas_triton.supports(supported, pages, pages) is None
    assert "16, 24" in attention_pallas_triton.supports(supported, pages, jnp.zeros((4, 16, 2, 24)))
    assert "page size 24" in attention_pallas_triton.supports(supported, *[jnp.zeros((4, 24, 2, 16))] * 2)
    with pytest.raises(ValueError, match="^implementation: paged attention is one of"):
        choose_attention(q, pages, pages, "cudnn")
