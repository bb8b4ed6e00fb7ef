"""Gated DeltaNet layer as in Qwen3-Next (HF `Qwen3NextGatedDeltaNet`): grouped qkvz/ba projections, short conv over
[q, k, v], the gated delta rule with L2-normalized q/k, per-head gated RMSNorm, out_proj; paged state pools."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.layers.common import Linear, PagedRunner, PlainRunner, ShortConv, a_log_init, dt_bias_init
from jaxckpt.layers.metadata import StepMetadata
from jaxckpt.layers.norm import GatedRMSNorm


class GatedDeltaNet(nnx.Module):
    """Qwen3-Next GDN; H key heads of K, HV value heads of V (r = HV / H value heads per key head).

    in_proj_qkvz.weight  [2HK + 2HV*V, d_model], output grouped per key head: [q (K) | k (K) | v (rV) | z (rV)]
    in_proj_ba.weight    [2HV, d_model], grouped per key head: [b (r) | a (r)]
    conv1d.weight        [conv_dim, W] over concat[q, k, v], conv_dim = 2HK + HV*V, no bias
    dt_bias, A_log [HV]; norm.weight [V] (shared by heads); out_proj.weight [d_model, HV*V]
    g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); out = RMSNorm(o) * w * silu(z).
    State per slot: conv window [conv_dim, W - 1] and delta-rule state [HV, K, V] ("kv"), fp32.
    """

    def __init__(self, d_model: int, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_width: int = 4, norm_eps: float = 1e-6, chunk_size: int = 64, dtype=jnp.float32,
                 implementation: str | None = None, rngs: nnx.Rngs):
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads: must be a multiple of num_k_heads={num_k_heads}, got {num_v_heads}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = conv_width
        self.chunk_size = chunk_size
        self.implementation = implementation
        self.in_proj_qkvz = Linear(d_model, 2 * self.key_dim + 2 * self.value_dim, dtype=dtype, rngs=rngs)
        self.in_proj_ba = Linear(d_model, 2 * num_v_heads, dtype=dtype, rngs=rngs)
        self.conv1d = ShortConv(self.conv_dim, conv_width, bias=False, dtype=dtype, rngs=rngs)
        self.dt_bias = nnx.Param(dt_bias_init(rngs.params(), (num_v_heads,)))
        self.A_log = nnx.Param(a_log_init(rngs.params(), (num_v_heads,)))
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps, gate="silu", norm_before_gate=True, dtype=dtype)
        self.out_proj = Linear(self.value_dim, d_model, dtype=dtype, rngs=rngs)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes of (conv_pool, recurrent_pool): ([conv_dim, W - 1], [HV, K, V])."""
        return (self.conv_dim, self.conv_width - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def get_prefill_checkpoint_alignment(self) -> int:
        return 1

    def _mix(self, x, runner):  # [T, d_model] -> [T, d_model]
        num_tokens = x.shape[0]
        H, HV, K, V = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        r = HV // H
        qkvz = self.in_proj_qkvz(x).reshape(num_tokens, H, 2 * K + 2 * r * V)
        q, k, v, z = jnp.split(qkvz, [K, 2 * K, 2 * K + r * V], axis=-1)
        b, a = jnp.split(self.in_proj_ba(x).reshape(num_tokens, H, 2 * r), [r], axis=-1)
        mixed = jnp.concatenate([q.reshape(num_tokens, -1), k.reshape(num_tokens, -1),
                                 v.reshape(num_tokens, -1)], axis=-1)  # [T, conv_dim]
        mixed = runner.conv(mixed, self.conv1d.weight[...])
        q, k, v = jnp.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        a32 = a.reshape(num_tokens, HV).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a32 + self.dt_bias[...])  # [T, HV]
        beta = jax.nn.sigmoid(b.reshape(num_tokens, HV).astype(jnp.float32))
        o = runner.scan(q.reshape(num_tokens, H, K), k.reshape(num_tokens, H, K), v.reshape(num_tokens, HV, V), g,
                        beta, use_qk_l2norm=True, state_layout="kv")  # [T, HV, V]
        o = self.norm(o.astype(x.dtype), z.reshape(num_tokens, HV, V))
        return self.out_proj(o.reshape(num_tokens, self.value_dim))

    @jax.named_scope("gated_delta_net")
    def __call__(self, x, meta: StepMetadata, pools):
        """x [T, d_model] packed rows; pools (conv_pool [S, conv_dim, W - 1], state_pool [S, HV, K, V]).

        Returns (out [T, d_model], (conv_pool, state_pool)) with final and checkpoint states written.
        """
        from jaxckpt.ops import gated_delta_rule_paged

        runner = PagedRunner(meta, pools, gated_delta_rule_paged, implementation=self.implementation,
                             chunk_size=self.chunk_size)
        return self._mix(x, runner), runner.pools

    def reference(self, x, *, implementation: str | None = "reference"):
        """One whole sequence x [T, d_model] from a zero state, no pools (float64 ops by default)."""
        from jaxckpt.ops import gated_delta_rule

        return self._mix(x, PlainRunner(gated_delta_rule, implementation=implementation, chunk_size=self.chunk_size))
