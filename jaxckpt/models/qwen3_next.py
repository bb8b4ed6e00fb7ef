"""Qwen3-Next (transformers' `Qwen3NextForCausalLM`) over paged caches: Gated DeltaNet and gated full-attention
layers, (1 + w) RMSNorms, a MoE MLP with a shared expert; read from a Hugging Face folder by the files' own names.

Module tree and parameter names are transformers': `model.embed_tokens`, `model.layers.{i}.{input_layernorm,
linear_attn | self_attn, post_attention_layernorm, mlp}`, `model.norm`, `lm_head`. The one difference is the routed
experts, stacked per layer into `mlp.experts.gate_up_proj` [E, d_model, 2I] and `mlp.experts.down_proj`
[E, I, d_model] for the grouped matmul (`jaxckpt.models.common.Experts`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxckpt.layers import GatedDeltaNet, Linear, StepMetadata
from jaxckpt.layers.attention import causal_attention, paged_attention, rope
from jaxckpt.models.common import (CausalLM, DecoderLayer, Experts, SwiGLUMLP, ZeroCenteredRMSNorm, build_model,
                                   config_dtype, read_config, read_safetensors, stack_experts)
from jaxckpt.models.hybrid import Embedding

_HF_LAYER_TYPES = {"linear_attention": "gdn", "full_attention": "attention"}


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig:
    """config.json's fields (transformers' `Qwen3NextConfig` names) and the serving sizes of our caches.

    `from_hf(config_json)` reads both the published form (`full_attention_interval`, `rope_theta`,
    `partial_rotary_factor` at the top level) and the one transformers 5 writes (`layer_types`, `rope_parameters`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]          # "linear_attention" | "full_attention" per layer
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
    tie_word_embeddings: bool = False
    # serving: KV page size, longest sequence, chunk of the recurrent ops, compute dtype, jaxckpt.ops implementation
    block_size: int = 16
    max_model_len: int = 4096
    chunk_size: int = 64
    dtype: str = "float32"
    implementation: str | None = None

    def __post_init__(self):
        bad = [t for t in self.layer_types if t not in _HF_LAYER_TYPES]
        if bad or not self.layer_types:
            raise ValueError(f"layer_types: must be a non-empty list of {sorted(_HF_LAYER_TYPES)}, got "
                             f"{list(self.layer_types)}")
        if self.max_model_len % self.block_size:
            raise ValueError(f"max_model_len: must be a multiple of block_size={self.block_size}, "
                             f"got {self.max_model_len}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor: head_dim * factor must be an even count in (0, head_dim], got "
                             f"{self.head_dim} * {self.partial_rotary_factor}")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Our cache kind of each layer ("gdn" or "attention"), `jaxckpt.models.hybrid.Caches.layer_types`."""
        return tuple(_HF_LAYER_TYPES[t] for t in self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, hf: Mapping, **serving) -> Qwen3NextConfig:
        """From config.json's dict; `serving` sets block_size, max_model_len, chunk_size, dtype, implementation."""
        if hf.get("model_type") != "qwen3_next":
            raise ValueError(f"config: model_type must be 'qwen3_next', got {hf.get('model_type')!r}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config: hidden_act must be 'silu', got {hf['hidden_act']!r}")
        rope_parameters = dict(hf.get("rope_parameters") or {})
        if rope_parameters.get("rope_type", "default") != "default":
            raise ValueError(f"config: only the default RoPE is supported, got rope_type "
                             f"{rope_parameters['rope_type']!r}")
        layers = hf.get("num_hidden_layers")
        layer_types = hf.get("layer_types")
        if layer_types is None:
            interval = hf.get("full_attention_interval", 4)
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
        if layers is not None and len(layer_types) != layers:
            raise ValueError(f"config: {len(layer_types)} layer_types for num_hidden_layers={layers}")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in hf.items() if k in fields}
        values.update(
            layer_types=tuple(layer_types), mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rope_theta=rope_parameters.get("rope_theta", hf.get("rope_theta", 10000.0)),
            partial_rotary_factor=rope_parameters.get("partial_rotary_factor",
                                                      hf.get("partial_rotary_factor", 0.25)))
        return cls(**(values | serving))


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
        attended, pools = paged_attention(q, k, v, meta, pools, block_size=self.block_size)
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


class Qwen3NextModel(nnx.Module):
    def __init__(self, config: Qwen3NextConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Qwen3NextDecoderLayer(config, i, rngs=rngs)
                                for i in range(config.num_hidden_layers)])
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next LM over paged caches (`common.CausalLM`: called as `HybridModel` is)."""

    def __init__(self, config: Qwen3NextConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Qwen3NextModel(config, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype=jnp.dtype(config.dtype), rngs=rngs)

    @classmethod
    def from_pretrained(cls, local_dir: str | os.PathLike, *, dtype: str | None = None, **serving):
        """Loads a Hugging Face Qwen3-Next folder (config.json, model.safetensors[.index.json]) by the files' own
        names, in `dtype` (default: the config's). `serving`: block_size, max_model_len, chunk_size,
        implementation. The multi-token-prediction head (`mtp.*`) is not used and not loaded."""
        return cls.from_params(read_config(local_dir), read_safetensors(local_dir), dtype=dtype, **serving)

    @classmethod
    def from_params(cls, hf_config: Mapping, params: Mapping[str, np.ndarray], *, dtype: str | None = None,
                    **serving):
        """As `from_pretrained`, from config.json's dict and {checkpoint name: array} (the files' names, or
        transformers' in-memory state dict with its fused experts). The model is built abstract and each parameter
        allocated once, from `params`."""
        config = Qwen3NextConfig.from_hf(hf_config, dtype=config_dtype(hf_config, dtype), **serving)
        params = {k: v for k, v in params.items() if not k.startswith("mtp.")}
        for i in range(config.num_hidden_layers):
            if config.is_moe_layer(i):
                stack_experts(params, f"model.layers.{i}.mlp", config.num_experts)
        if config.tie_word_embeddings:
            params.pop("lm_head.weight", None)
        return build_model(cls, config, params)
