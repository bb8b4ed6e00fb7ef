"""GraniteMoeHybrid (transformers' `GraniteMoeHybridForCausalLM`, IBM's granite-4.0-h family) over paged caches:
Mamba2 and GQA attention layers (RoPE or none), RMSNorms, a top-k softmax MoE beside a shared SwiGLU MLP in every
layer, and Granite's embedding / residual / attention / logits multipliers; read from a Hugging Face folder by the
files' own names.

Module tree and parameter names are transformers' in-memory ones (`model.layers.{i}.{input_layernorm, mamba |
self_attn, post_attention_layernorm, block_sparse_moe, shared_mlp}`); the files name the MoE weights
`block_sparse_moe.input_linear` [E, 2I, d_model], `output_linear` [E, d_model, I] and `router.layer`, which load into
`block_sparse_moe.experts.gate_up_proj` [E, d_model, 2I], `experts.down_proj` [E, I, d_model] and `router.weight`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxckpt.layers import Attention, Linear, Mamba2Mixer, RMSNorm
from jaxckpt.layers.attention import rope
from jaxckpt.models.common import (CausalLM, DecoderLayer, DecoderModel, Experts, PublishedConfig, default_rope,
                                   rename_params, stack_experts)

# the published (legacy) config.json layer names -> transformers 5's
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
# the files' names -> transformers' in-memory ones (its conversion mapping, run backwards on save)
_RENAMES = ((r"\.block_sparse_moe\.input_linear\.weight$", ".block_sparse_moe.experts.gate_up_proj"),
            (r"\.block_sparse_moe\.output_linear\.weight$", ".block_sparse_moe.experts.down_proj"),
            (r"\.block_sparse_moe\.router\.layer\.weight$", ".block_sparse_moe.router.weight"))


def _float(value) -> float:
    """A config.json number, including transformers' {"__float__": "Infinity"} and the strings "inf" / "Infinity"."""
    if isinstance(value, Mapping):
        value = value.get("__float__")
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraniteMoeHybridConfig(PublishedConfig):
    """config.json's fields (transformers' `GraniteMoeHybridConfig` names) and the serving sizes of our caches
    (`common.PublishedConfig`; `layer_types` "linear_attention" (Mamba2) | "full_attention" per layer, `from_hf`
    also reads the published "mamba" / "attention")."""

    model_type: ClassVar[str] = "granitemoehybrid"
    layer_kinds: ClassVar[Mapping[str, str]] = {"linear_attention": "mamba2", "full_attention": "attention"}

    num_attention_heads: int
    num_key_value_heads: int
    mamba_n_heads: int
    mamba_d_head: int
    mamba_d_state: int
    mamba_n_groups: int = 1
    mamba_d_conv: int = 4
    intermediate_size: int = 0             # width of each routed expert
    shared_intermediate_size: int = 0
    num_local_experts: int = 0
    num_experts_per_tok: int = 1
    position_embedding_type: str | None = None  # "rope", or None / "nope": no positional encoding
    rope_theta: float = 10000.0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        if self.position_embedding_type not in (None, "nope", "rope"):
            raise ValueError(f"position_embedding_type: must be 'rope', 'nope' or None, got "
                             f"{self.position_embedding_type!r}")
        if self.num_local_experts and not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"num_experts_per_tok: must lie in [1, num_local_experts={self.num_local_experts}], "
                             f"got {self.num_experts_per_tok}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def derived_fields(cls, hf: Mapping) -> dict:
        # what Mamba2Mixer and our attention do not have: a conv without bias, biased projections, a dt clamp
        for name, supported in (("mamba_conv_bias", True), ("mamba_proj_bias", False), ("attention_bias", False)):
            if hf.get(name, supported) != supported:
                raise ValueError(f"config: {name} must be {supported}, got {hf[name]!r}")
        limit = tuple(map(_float, hf.get("time_step_limit") or (0.0, math.inf)))
        if limit != (0.0, math.inf):
            raise ValueError(f"config: time_step_limit must be (0, inf) (no dt clamp), got {limit}")
        rope_parameters = default_rope(hf)
        layer_types = [_LEGACY_LAYER_TYPES.get(t, t) for t in hf.get("layer_types") or hf.get("layers_block_type")
                       or ["linear_attention"] * hf.get("num_hidden_layers")]
        unknown = [t for t in layer_types if t not in cls.layer_kinds]
        if unknown:
            raise ValueError(f"config: layer_types holds {unknown}, not one of "
                             f"{sorted({*cls.layer_kinds, *_LEGACY_LAYER_TYPES})}")
        hidden, heads = hf["hidden_size"], hf.get("mamba_n_heads", 128)
        d_head = hf.get("mamba_d_head", "auto")
        if d_head == "auto":
            d_head = hf.get("mamba_expand", 2) * hidden // heads
        if d_head * heads != hf.get("mamba_expand", 2) * hidden:
            raise ValueError(f"config: mamba_n_heads * mamba_d_head = {heads * d_head} must equal mamba_expand * "
                             f"hidden_size = {hf.get('mamba_expand', 2) * hidden}")
        return dict(layer_types=tuple(layer_types),
                    num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                    mamba_n_heads=heads, mamba_d_head=d_head,
                    rope_theta=rope_parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))


class GraniteMoeHybridAttention(Attention):
    """GQA attention with Granite's scale (`attention_multiplier` instead of head_dim^-1/2) and RoPE only when the
    config asks for it; names and KV pages as `jaxckpt.layers.Attention`."""

    def __init__(self, d_model: int, *, scale: float, use_rope: bool, **attention):
        super().__init__(d_model, **attention)
        self.scale, self.use_rope = scale, use_rope

    def _qkv(self, x, positions):
        num_tokens, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).reshape(num_tokens, H, D)
        k = self.k_proj(x).reshape(num_tokens, Hkv, D)
        v = self.v_proj(x).reshape(num_tokens, Hkv, D)
        if self.use_rope:
            q, k = (rope(a, positions, theta=self.rope_theta) for a in (q, k))
        q = (q.astype(jnp.float32) * self.scale).reshape(num_tokens, Hkv, H // Hkv, D)
        return q, k, v


class GraniteMoeHybridMLP(nnx.Module):
    """The shared MLP: input_linear [2S, d_model] gives [gate | up], output_linear(silu(gate) * up) [d_model, S]."""

    def __init__(self, d_model: int, d_ff: int, *, dtype, rngs: nnx.Rngs):
        self.input_linear = Linear(d_model, 2 * d_ff, dtype=dtype, rngs=rngs)
        self.output_linear = Linear(d_ff, d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x):  # [T, d_model]
        gate, up = jnp.split(self.input_linear(x), 2, axis=-1)
        return self.output_linear(jax.nn.silu(gate) * up)


class GraniteMoeHybridTopKRouter(nnx.Module):
    """The top-k of the router logits (weight [E, d_model], in the model dtype), softmax over those k in fp32."""

    def __init__(self, config: GraniteMoeHybridConfig, *, dtype, rngs: nnx.Rngs):
        self.top_k = config.num_experts_per_tok
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (config.num_local_experts, config.hidden_size))
                                 * config.hidden_size ** -0.5).astype(dtype))

    def __call__(self, x):
        """x [T, d_model] -> (weights [T, k] in x's dtype, experts i32[T, k]), highest logit first."""
        logits = jnp.einsum("td,ed->te", x, self.weight[...], precision=jax.lax.Precision.HIGHEST)
        top, indices = jax.lax.top_k(logits.astype(jnp.float32), self.top_k)
        return jax.nn.softmax(top, axis=-1).astype(x.dtype), indices


class GraniteMoeHybridMoE(nnx.Module):
    def __init__(self, config: GraniteMoeHybridConfig, *, dtype, rngs: nnx.Rngs):
        self.router = GraniteMoeHybridTopKRouter(config, dtype=dtype, rngs=rngs)
        self.experts = Experts(config.num_local_experts, config.hidden_size, config.intermediate_size, dtype=dtype,
                               rngs=rngs)

    def route(self, x):
        return self.router(x)

    def __call__(self, x):  # [T, d_model]
        return self.experts(x, *self.router(x))


class GraniteMoeHybridDecoderLayer(DecoderLayer):
    """x + r * mixer(input_layernorm(x)), then x + r * (block_sparse_moe + shared_mlp)(post_attention_layernorm(x)),
    r = residual_multiplier; the mixer is `mamba` (Mamba2) or `self_attn`; no MoE when num_local_experts is 0."""

    def __init__(self, config: GraniteMoeHybridConfig, index: int, *, rngs: nnx.Rngs):
        c = config
        dtype = jnp.dtype(c.dtype)
        self.residual_multiplier = c.residual_multiplier
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        if c.layer_types[index] == "linear_attention":
            self.mamba = Mamba2Mixer(
                c.hidden_size, num_heads=c.mamba_n_heads, head_dim=c.mamba_d_head, d_state=c.mamba_d_state,
                n_groups=c.mamba_n_groups, conv_width=c.mamba_d_conv, norm_eps=c.rms_norm_eps,
                chunk_size=c.chunk_size, dtype=dtype, implementation=c.implementation, rngs=rngs)
        else:
            self.self_attn = GraniteMoeHybridAttention(
                c.hidden_size, scale=c.attention_multiplier, use_rope=c.position_embedding_type == "rope",
                num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                block_size=c.block_size, rope_theta=c.rope_theta, implementation=c.attention_implementation,
                dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        self.block_sparse_moe = GraniteMoeHybridMoE(c, dtype=dtype, rngs=rngs) if c.num_local_experts else None
        self.shared_mlp = GraniteMoeHybridMLP(c.hidden_size, c.shared_intermediate_size, dtype=dtype, rngs=rngs)

    @property
    def mixer(self):
        return self.mamba if hasattr(self, "mamba") else self.self_attn

    def feed_forward(self, x):
        shared = self.shared_mlp(x)
        return shared if self.block_sparse_moe is None else self.block_sparse_moe(x) + shared


class GraniteMoeHybridModel(DecoderModel):
    layer_class = GraniteMoeHybridDecoderLayer
    norm_class = RMSNorm


class GraniteMoeHybridForCausalLM(CausalLM):
    """GraniteMoeHybrid LM over paged caches (`common.CausalLM`: called as `HybridModel` is; `from_pretrained`
    reads a Hugging Face folder); embeddings scaled by embedding_multiplier, logits divided by logits_scaling."""

    config_class = GraniteMoeHybridConfig
    model_class = GraniteMoeHybridModel

    def embed(self, tokens):
        return self.model.embed_tokens(tokens) * self.config.embedding_multiplier

    def logits(self, hidden):
        return super().logits(hidden) / self.config.logits_scaling

    @classmethod
    def checkpoint_params(cls, config: GraniteMoeHybridConfig,
                          params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The files' MoE names renamed to transformers' in-memory ones, experts stacked."""
        params = rename_params(params, _RENAMES)
        if config.num_local_experts:
            for i in range(config.num_hidden_layers):
                stack_experts(params, f"model.layers.{i}.block_sparse_moe", config.num_local_experts)
        return params
