"""The Pallas Triton paged flash attention compiled for the GPU against the plain paged attention: the bench model's
head layout (8 query heads per KV head, head dim 128) at the serving benchmark's page sizes, fp32 and bf16, and
whole-model logits with either attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxckpt.layers.attention import paged_attention
from jaxckpt.layers.metadata import StepMetadata
from jaxckpt.models import hybrid
from jaxckpt.models.hybrid import HybridConfig, HybridModel
from tests.layers.attention_cases import paged_step
from tests.numerics import rel_rms

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("page", [16, 528, 768])
def test_flash_matches_plain_on_the_gpu(page, dtype):
    rng = np.random.default_rng(page)
    kv_heads, groups, dim = 2, 8, 128
    query_lens, context_lens = [1, 1, 1, 2000, 700, 1300], [3000, 17, 800, 0, 1500, 2 * page]
    num_pages = sum(-(-(q + c) // page) for q, c in zip(query_lens, context_lens)) + 2
    meta = jax.tree.map(jnp.asarray, paged_step(rng, page=page, query_lens=query_lens, context_lens=context_lens,
                                                num_pages=num_pages, num_rows=8))
    num_tokens = meta.positions.shape[0]
    dt = jnp.dtype(dtype)
    q = jnp.asarray(rng.standard_normal((num_tokens, kv_heads, groups, dim)), jnp.float32) * dim ** -0.5
    k = jnp.asarray(rng.standard_normal((num_tokens, kv_heads, dim)), dt)
    v = jnp.asarray(rng.standard_normal((num_tokens, kv_heads, dim)), dt)
    pages = tuple(jnp.where(jnp.arange(num_pages)[:, None, None, None] % 5 == 0, jnp.nan,
                            jnp.asarray(rng.standard_normal((num_pages, page, kv_heads, dim)), dt)) for _ in range(2))
    # the NaN pages (every fifth) are never some row's: only its pages are read
    owned = set(np.asarray(meta.block_tables).ravel().tolist()) - {0}
    pages = tuple(p.at[jnp.asarray(sorted(owned))].set(
        jnp.asarray(rng.standard_normal((len(owned), page, kv_heads, dim)), dt)) for p in pages)
    plain, _ = jax.jit(lambda *a: paged_attention(*a, block_size=page, implementation="xla"))(q, k, v, meta, pages)
    fast, _ = jax.jit(lambda *a: paged_attention(*a, block_size=page, implementation="pallas_triton"))(
        q, k, v, meta, pages)
    real = int(meta.cu_seqlens[-1])
    err = rel_rms(fast[:real], plain[:real])
    # fp32: both at HIGHEST; bf16: the probabilities are rounded to bf16 before P @ V on either path, at
    # different points of the online softmax
    assert err <= (1e-5 if dtype == "float32" else 1e-2), err
    assert np.isfinite(np.asarray(fast)).all()


def test_model_logits_with_either_attention():
    rng = np.random.default_rng(3)
    configs = {impl: HybridConfig.bench(layer_types=("gdn", "attention"), max_model_len=528 * 8, block_size=528,
                                        vocab_size=4096, attention_implementation=impl, dtype="float32")
               for impl in ("xla", "pallas_triton")}
    model = HybridModel(configs["xla"], rngs=nnx.Rngs(0))
    fast_model = HybridModel(configs["pallas_triton"], rngs=nnx.Rngs(0))
    nnx.update(fast_model, nnx.state(model))
    tokens = rng.integers(0, 4096, 3000).astype(np.int32)
    pages = -(-3000 // 528) + 1
    meta = StepMetadata.build([3000], context_lens=[0], block_tables=[np.arange(1, pages)],
                              initial_state_indices=[0], final_state_indices=[1], block_size=528,
                              num_kv_pages=pages, num_state_slots=2, num_rows=1, num_tokens=4096)
    padded = np.zeros(4096, np.int32)
    padded[:3000] = tokens
    logits = {}
    for impl, m in (("xla", model), ("pallas_triton", fast_model)):
        caches = m.init_caches(pages, 2)
        logits[impl], _ = hybrid.forward(*nnx.split(m), padded, meta, caches)
    assert rel_rms(logits["pallas_triton"][0], logits["xla"][0]) <= 1e-4
