"""Qwen3-Next (transformers' `Qwen3NextForCausalLM`) over paged caches: Gated DeltaNet and gated full-attention
layers, (1 + w) RMSNorms, a MoE MLP with a shared expert; read from a Hugging Face folder by the files' own names.

Module tree and parameter names are transformers': `model.embed_tokens`, `model.layers.{i}.{input_layernorm,
linear_attn | self_attn, post_attention_layernorm, mlp}`, `model.norm`, `lm_head`. The one difference is the routed
experts, stacked per layer into `mlp.experts.gate_up_proj` [E, d_model, 2I] and `mlp.experts.down_proj`
[E, I, d_model] for the grouped matmul (`jaxckpt.models.common.Experts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxckpt.layers import GatedDeltaNet, Linear, StepMetadata
from jaxckpt.layers.attention import causal_attention, check_attention_implementation, paged_attention, rope
from jaxckpt.models.common import (CausalLM, DecoderLayer, DecoderModel, Experts, PublishedConfig, SwiGLUMLP,
                                   ZeroCenteredRMSNorm, default_rope, stack_experts)

@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3NextConfig(PublishedConfig):
    """config.json's fields (transformers' `Qwen3NextConfig` names) and the serving sizes of our caches
    (`common.PublishedConfig`; `layer_types` "linear_attention" | "full_attention" per layer).

    `from_hf(config_json)` reads both the published form (`full_attention_interval`, `rope_theta`,
    `partial_rotary_factor` at the top level) and the one transformers 5 writes (`layer_types`, `rope_parameters`).
    """

    model_type: ClassVar[str] = "qwen3_next"
    layer_kinds: ClassVar[Mapping[str, str]] = {"linear_attention": "gdn", "full_attention": "attention"}

    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor: head_dim * factor must be an even count in (0, head_dim], got "
                             f"{self.head_dim} * {self.partial_rotary_factor}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def derived_fields(cls, hf: Mapping) -> dict:
        rope_parameters = default_rope(hf)
        layer_types = hf.get("layer_types")
        if layer_types is None:
            interval = hf.get("full_attention_interval", 4)
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention"
                           for i in range(hf.get("num_hidden_layers"))]
        return dict(
            layer_types=tuple(layer_types), mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rope_theta=rope_parameters.get("rope_theta", hf.get("rope_theta", 10000.0)),
            partial_rotary_factor=rope_parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))


class Qwen3NextAttention(nnx.Module):
    """Gated GQA: q_proj [H * 2D, d_model] gives per head [query (D) | gate (D)]; q_norm / k_norm (1 + w) over each
    head; RoPE on the first `rotary_dim` channels; out = o_proj(attention * sigmoid(gate)). KV pages hold the normed,
    rotated keys and the values, [P, block_size, Hkv, D] each."""

    def __init__(self, config: Qwen3NextConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        if c.num_attention_heads % c.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: must divide num_attention_heads={c.num_attention_heads}, got "
                             f"{c.num_key_value_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rotary_dim, self.rope_theta, self.block_size = c.rotary_dim, c.rope_theta, c.block_size
        self.implementation = check_attention_implementation(c.attention_implementation)
        H, Hkv, D, d = self.num_heads, self.num_kv_heads, self.head_dim, c.hidden_size
        bias = c.attention_bias
        self.q_proj = Linear(d, 2 * H * D, bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, Hkv * D, bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, Hkv * D, bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(H * D, d, bias=bias, dtype=dtype, rngs=rngs)
        self.q_norm = ZeroCenteredRMSNorm(D, eps=c.rms_norm_eps, dtype=dtype)
        self.k_norm = ZeroCenteredRMSNorm(D, eps=c.rms_norm_eps, dtype=dtype)

    @property
    def page_shapes(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Shapes of one K page and one V page: [block_size, Hkv, D] each."""
        return (self.block_size, self.num_kv_heads, self.head_dim), (self.block_size, self.num_kv_heads, self.head_dim)

    def _qkv(self, x, positions):
        num_tokens = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, gate = jnp.split(self.q_proj(x).reshape(num_tokens, H, 2 * D), 2, axis=-1)
        q = rope(self.q_norm(q), positions, theta=self.rope_theta, rotary_dim=self.rotary_dim)
        k = rope(self.k_norm(self.k_proj(x).reshape(num_tokens, Hkv, D)), positions, theta=self.rope_theta,
                 rotary_dim=self.rotary_dim)
        v = self.v_proj(x).reshape(num_tokens, Hkv, D)
        q = (q.astype(jnp.float32) * D ** -0.5).reshape(num_tokens, Hkv, H // Hkv, D)  # [T, Hkv, r, D]
        return q, k, v, gate.reshape(num_tokens, H * D)

    def _out(self, attended, gate, dtype):
        return self.o_proj(attended.reshape(gate.shape).astype(dtype) * jax.nn.sigmoid(gate))

    @jax.named_scope("qwen3_next_attention")
    def __call__(self, x, meta: StepMetadata, pools):
        """x [T, d_model] packed rows; pools (k_pages, v_pages). Returns (out [T, d_model], pools)."""
        q, k, v, gate = self._qkv(x, meta.positions)
        attended, pools = paged_attention(q, k, v, meta, pools, block_size=self.block_size,
                                          implementation=self.implementation)
        return self._out(attended, gate, x.dtype), pools

    def reference(self, x, *, implementation=None):
        """One whole sequence x [T, d_model], dense causal attention, no cache."""
        q, k, v, gate = self._qkv(x, jnp.arange(x.shape[0]))
        return self._out(causal_attention(q, k, v), gate, x.dtype)


class Qwen3NextSparseMoeBlock(nnx.Module):
    """Top-k softmax routing (`gate` [E, d_model]; renormalized when norm_topk_prob) over `experts`, plus a shared
    expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: Qwen3NextConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        if not 0 < c.num_experts_per_tok <= c.num_experts:
            raise ValueError(f"num_experts_per_tok: must lie in [1, num_experts={c.num_experts}], got "
                             f"{c.num_experts_per_tok}")
        self.top_k, self.norm_topk_prob = c.num_experts_per_tok, c.norm_topk_prob
        self.gate = Linear(c.hidden_size, c.num_experts, dtype=dtype, rngs=rngs)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, dtype=dtype, rngs=rngs)
        self.shared_expert = SwiGLUMLP(c.hidden_size, c.shared_expert_intermediate_size, dtype=dtype, rngs=rngs)
        self.shared_expert_gate = Linear(c.hidden_size, 1, dtype=dtype, rngs=rngs)

    def route(self, x):
        """x [T, d_model] -> (weights [T, k] in x's dtype, experts i32[T, k]), highest probability first."""
        logits = self.gate(x)
        weights, indices = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), self.top_k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return weights.astype(logits.dtype), indices

    def __call__(self, x):  # [T, d_model]
        routed = self.experts(x, *self.route(x))
        return routed + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(DecoderLayer):
    """x + mixer(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)); the mixer is `linear_attn` (GDN) or
    `self_attn`."""

    def __init__(self, config: Qwen3NextConfig, index: int, *, rngs: nnx.Rngs):
        c = config
        dtype = jnp.dtype(c.dtype)
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        if c.layer_types[index] == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                c.hidden_size, num_k_heads=c.linear_num_key_heads, num_v_heads=c.linear_num_value_heads,
                head_k_dim=c.linear_key_head_dim, head_v_dim=c.linear_value_head_dim,
                conv_width=c.linear_conv_kernel_dim, norm_eps=c.rms_norm_eps, chunk_size=c.chunk_size, dtype=dtype,
                implementation=c.implementation, rngs=rngs)
        else:
            self.self_attn = Qwen3NextAttention(c, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        if c.is_moe_layer(index):
            self.mlp = Qwen3NextSparseMoeBlock(c, dtype=dtype, rngs=rngs)
        else:
            self.mlp = SwiGLUMLP(c.hidden_size, c.intermediate_size, dtype=dtype, rngs=rngs)

    @property
    def mixer(self):
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn


class Qwen3NextModel(DecoderModel):
    layer_class = Qwen3NextDecoderLayer
    norm_class = ZeroCenteredRMSNorm


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next LM over paged caches (`common.CausalLM`: called as `HybridModel` is; `from_pretrained` reads a
    Hugging Face folder). The multi-token-prediction head (`mtp.*`) is not used and not loaded."""

    config_class = Qwen3NextConfig
    model_class = Qwen3NextModel

    @classmethod
    def checkpoint_params(cls, config: Qwen3NextConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The routed experts stacked (from the files' per-expert names or transformers' fused ones); `mtp.*` left
        out."""
        params = {k: v for k, v in params.items() if not k.startswith("mtp.")}
        for i in range(config.num_hidden_layers):
            if config.is_moe_layer(i):
                stack_experts(params, f"model.layers.{i}.mlp", config.num_experts)
        return params
