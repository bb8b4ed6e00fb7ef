"""Kimi Delta Attention layer as in Kimi-Linear (vLLM `layers/kda.py`): q/k/v projections with three short convs,
the fused per-channel gate, the delta rule with L2-normalized q/k, sigmoid-gated output RMSNorm; paged state pools."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.layers.common import Linear, PagedRunner, PlainRunner, ShortConv, a_log_init, dt_bias_init
from jaxckpt.layers.metadata import StepMetadata
from jaxckpt.layers.norm import GatedRMSNorm


class KimiDeltaAttention(nnx.Module):
    """Kimi-Linear KDA with H heads of K = V = head_dim (HD = H * head_dim); names as Kimi-Linear / vLLM.

    q_proj, k_proj, v_proj.weight        [HD, d_model]
    q_conv1d, k_conv1d, v_conv1d.weight  [HD, W] each (torch [HD, 1, W] loads too), no bias
    f_a_proj.weight [head_dim, d_model], f_b_proj.weight [HD, head_dim]: raw gate; A_log [H] (vLLM's [1, 1, H, 1]
    loads too), dt_bias [HD]: log decay -exp(A_log[h]) * softplus(raw + dt_bias) (fused inside jaxckpt.ops.kda)
    b_proj.weight [H, d_model]: beta = sigmoid
    g_a_proj.weight [head_dim, d_model], g_b_proj.weight [HD, head_dim]; o_norm.weight [head_dim];
    o_proj.weight [d_model, HD]: out = o_proj(RMSNorm(o) * w * sigmoid(g_b_proj(g_a_proj(x))))
    State per slot: the three conv windows in one conv pool [3HD, W - 1] (channels q | k | v) and the delta-rule state
    [H, K, V] ("kv"), fp32.
    """

    def __init__(self, d_model: int, *, num_heads: int, head_dim: int, conv_width: int = 4, norm_eps: float = 1e-5,
                 chunk_size: int = 64, dtype=jnp.float32, implementation: str | None = None, rngs: nnx.Rngs):
        self.num_heads, self.head_dim = num_heads, head_dim
        self.proj_dim = num_heads * head_dim
        self.conv_width = conv_width
        self.chunk_size = chunk_size
        self.implementation = implementation
        HD = self.proj_dim
        self.q_proj = Linear(d_model, HD, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d_model, HD, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d_model, HD, dtype=dtype, rngs=rngs)
        self.q_conv1d = ShortConv(HD, conv_width, bias=False, dtype=dtype, rngs=rngs)
        self.k_conv1d = ShortConv(HD, conv_width, bias=False, dtype=dtype, rngs=rngs)
        self.v_conv1d = ShortConv(HD, conv_width, bias=False, dtype=dtype, rngs=rngs)
        self.f_a_proj = Linear(d_model, head_dim, dtype=dtype, rngs=rngs)
        self.f_b_proj = Linear(head_dim, HD, dtype=dtype, rngs=rngs)
        self.A_log = nnx.Param(a_log_init(rngs.params(), (num_heads,)))
        self.dt_bias = nnx.Param(dt_bias_init(rngs.params(), (HD,)))
        self.b_proj = Linear(d_model, num_heads, dtype=dtype, rngs=rngs)
        self.g_a_proj = Linear(d_model, head_dim, dtype=dtype, rngs=rngs)
        self.g_b_proj = Linear(head_dim, HD, dtype=dtype, rngs=rngs)
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps, gate="sigmoid", norm_before_gate=True, dtype=dtype)
        self.o_proj = Linear(HD, d_model, dtype=dtype, rngs=rngs)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes of (conv_pool, recurrent_pool): ([3 * H * K, W - 1], [H, K, V])."""
        return (3 * self.proj_dim, self.conv_width - 1), (self.num_heads, self.head_dim, self.head_dim)

    def get_prefill_checkpoint_alignment(self) -> int:
        return 1

    def _mix(self, x, runner):  # [T, d_model] -> [T, d_model]
        num_tokens = x.shape[0]
        H, K = self.num_heads, self.head_dim
        # one depthwise conv over [q | k | v] equals the three separate convs, and keeps one conv pool per layer
        qkv = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)  # [T, 3HD]
        weight = jnp.concatenate([self.q_conv1d.weight[...], self.k_conv1d.weight[...], self.v_conv1d.weight[...]])
        q, k, v = jnp.split(runner.conv(qkv, weight), 3, axis=-1)
        raw_g = self.f_b_proj(self.f_a_proj(x)).reshape(num_tokens, H, K)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))  # [T, H]
        o = runner.scan(q.reshape(num_tokens, H, K), k.reshape(num_tokens, H, K), v.reshape(num_tokens, H, K), raw_g,
                        beta, A_log=self.A_log[...], dt_bias=self.dt_bias[...], use_qk_l2norm=True,
                        state_layout="kv")  # [T, H, V]
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(num_tokens, H, K)
        o = self.o_norm(o.astype(x.dtype), gate)
        return self.o_proj(o.reshape(num_tokens, self.proj_dim))

    @jax.named_scope("kimi_delta_attention")
    def __call__(self, x, meta: StepMetadata, pools):
        """x [T, d_model] packed rows; pools (conv_pool [S, 3HD, W - 1], state_pool [S, H, K, V]).

        Returns (out [T, d_model], (conv_pool, state_pool)) with final and checkpoint states written.
        """
        from jaxckpt.ops import kda_paged

        runner = PagedRunner(meta, pools, kda_paged, implementation=self.implementation, chunk_size=self.chunk_size)
        return self._mix(x, runner), runner.pools

    def reference(self, x, *, implementation: str | None = "reference"):
        """One whole sequence x [T, d_model] from a zero state, no pools (float64 ops by default)."""
        from jaxckpt.ops import kda

        return self._mix(x, PlainRunner(kda, implementation=implementation, chunk_size=self.chunk_size))
