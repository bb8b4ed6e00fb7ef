"""Kimi-Linear (transformers' `KimiLinearForCausalLM`) over paged caches: Kimi Delta Attention and multi-head latent
attention (MLA, no positional encoding) layers, RMSNorms, a MoE MLP with sigmoid group-limited routing and shared
experts; read from a Hugging Face folder by the files' own names.

Module tree and parameter names are transformers' in-memory ones (`model.layers.{i}.{input_layernorm, self_attn,
post_attention_layernorm, mlp}`), but for three places where we keep the files' layout: the KDA layer's
`f_a_proj`, `f_b_proj`, `dt_bias`, `A_log` sit in `self_attn` (transformers nests them in `self_attn.forget_gate`),
its three convs stay `q_conv1d` / `k_conv1d` / `v_conv1d` (transformers fuses them into `conv1d`), and the routed
experts are stacked into `mlp.experts.gate_up_proj` [E, d_model, 2I] / `down_proj` [E, I, d_model] for the grouped
matmul. `from_params` reads either form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxckpt.layers import KimiDeltaAttention, Linear, RMSNorm, StepMetadata
from jaxckpt.layers.attention import causal_attention
from jaxckpt.layers.mla import paged_latent_attention
from jaxckpt.models.common import (CausalLM, DecoderLayer, DecoderModel, Experts, PublishedConfig, SwiGLUMLP,
                                   rename_params, stack_experts)

_HIGHEST = jax.lax.Precision.HIGHEST
# transformers' in-memory names -> ours (the files'): forget gate un-nested, MoE blocks under `mlp`
_RENAMES = ((r"\.block_sparse_moe\.", ".mlp."), (r"\.self_attn\.forget_gate\.", ".self_attn."))
_LATENT_NORM_EPS = 1e-6  # transformers builds kv_a_layernorm / q_a_layernorm with its RMSNorm's default eps


@dataclasses.dataclass(frozen=True, kw_only=True)
class KimiLinearConfig(PublishedConfig):
    """config.json's fields (transformers' `KimiLinearConfig` attribute names) and the serving sizes of our caches
    (`common.PublishedConfig`; `layer_types` "linear_attention" | "full_attention" per layer).

    `from_hf(config_json)` reads both the published form (`linear_attn_config`, `first_k_dense_replace`,
    `num_experts`, ...) and the one transformers 5 writes (`layer_types`, `mlp_layer_types`).
    """

    model_type: ClassVar[str] = "kimi_linear"
    layer_kinds: ClassVar[Mapping[str, str]] = {"linear_attention": "kda", "full_attention": "attention"}
    # config.json names transformers writes (its attribute_map) -> the config attributes
    hf_aliases: ClassVar[Mapping[str, str]] = {
        "num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
        "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob"}

    intermediate_size: int
    num_attention_heads: int
    mlp_layer_types: tuple[str, ...]      # "dense" | "sparse" per layer
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int = 4
    q_lora_rank: int | None = None
    num_key_value_heads: int | None = None
    moe_intermediate_size: int = 0
    num_local_experts: int = 0
    num_experts_per_tok: int = 1
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False

    def __post_init__(self):
        super().__post_init__()
        if len(self.mlp_layer_types) != len(self.layer_types) or not set(self.mlp_layer_types) <= {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types: must hold 'dense' or 'sparse' for each of the {len(self.layer_types)} "
                             f"layers, got {list(self.mlp_layer_types)}")
        if self.attention_implementation is not None:
            raise ValueError(f"attention_implementation: Kimi-Linear's MLA attends over its latent pages on one path, "
                             f"so it takes None, got {self.attention_implementation!r}")
        if self.num_key_value_heads not in (None, self.num_attention_heads):
            raise ValueError(f"num_key_value_heads: MLA expands its latent to every head, so it must equal "
                             f"num_attention_heads={self.num_attention_heads}, got {self.num_key_value_heads}")
        if "sparse" in self.mlp_layer_types:
            E, G = self.num_local_experts, self.n_group
            if E < 1 or G < 1 or E % G:
                raise ValueError(f"n_group: must divide num_local_experts={E}, got {G}")
            if E // G < 2:
                raise ValueError(f"n_group: each group needs 2 experts or more (its score is the sum of its top 2), "
                                 f"got {E // G}")
            if not 0 < self.topk_group <= G:
                raise ValueError(f"topk_group: must lie in [1, n_group={G}], got {self.topk_group}")
            if not 0 < self.num_experts_per_tok <= self.topk_group * (E // G):
                raise ValueError(f"num_experts_per_tok: must lie in [1, topk_group * experts per group = "
                                 f"{self.topk_group * (E // G)}], got {self.num_experts_per_tok}")

    @classmethod
    def derived_fields(cls, hf: Mapping) -> dict:
        # fields transformers ignores; a value other than the one it assumes would mean another model
        for name, assumed in (("moe_router_activation_func", "sigmoid"), ("mla_use_nope", True),
                              ("moe_layer_freq", 1)):
            if hf.get(name, assumed) != assumed:
                raise ValueError(f"config: {name} must be {assumed!r} (transformers' Kimi-Linear), got {hf[name]!r}")
        layers = hf["num_hidden_layers"]
        linear = hf.get("linear_attn_config") or {}
        layer_types = hf.get("layer_types")
        if layer_types is None and "full_attn_layers" in linear:
            full = set(linear["full_attn_layers"])  # 1-based in the published config
            layer_types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(layers)]
        if layer_types is None:
            layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
        mlp_layer_types = hf.get("mlp_layer_types")
        if mlp_layer_types is None:
            dense = hf.get("first_k_dense_replace", 1)
            mlp_layer_types = ["dense" if i < dense else "sparse" for i in range(layers)]
        return dict(layer_types=tuple(layer_types), mlp_layer_types=tuple(mlp_layer_types),
                    linear_num_heads=linear.get("num_heads", hf.get("linear_num_heads", 32)),
                    linear_head_dim=linear.get("head_dim", hf.get("linear_head_dim", 128)),
                    linear_conv_kernel_dim=linear.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4)))


class KimiLinearAttention(nnx.Module):
    """MLA without positional encoding (transformers' `KimiLinearAttention`); H heads, latent rank R, query/key
    channels Dn + Dr (the last Dr shared by all heads, unrotated), value channels Dv.

    q_proj [H (Dn + Dr), d_model], or q_a_proj [Rq, d_model] -> q_a_layernorm -> q_b_proj [H (Dn + Dr), Rq];
    kv_a_proj_with_mqa [R + Dr, d_model] -> (latent c: kv_a_layernorm, shared key k_r); kv_b_proj [H (Dn + Dv), R]
    per head [W_uk (Dn) | W_uv (Dv)]; o_proj [d_model, H Dv]. Scale (Dn + Dr)^-1/2.
    KV pages hold the latent and the shared key: [P, block_size, 1, R] and [P, block_size, 1, Dr] (transformers'
    cache: keys [1, T, R], values [1, T, Dr]).
    """

    def __init__(self, config: KimiLinearConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.kv_lora_rank, self.block_size = c.num_attention_heads, c.kv_lora_rank, c.block_size
        self.nope_dim, self.rope_dim, self.v_head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        H, d, qk = self.num_heads, c.hidden_size, c.qk_nope_head_dim + c.qk_rope_head_dim
        self.scale = qk ** -0.5
        if c.q_lora_rank is None:
            self.q_proj = Linear(d, H * qk, dtype=dtype, rngs=rngs)
        else:
            self.q_a_proj = Linear(d, c.q_lora_rank, bias=c.attention_bias, dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=_LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(c.q_lora_rank, H * qk, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(d, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias, dtype=dtype,
                                         rngs=rngs)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps=_LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(H * c.v_head_dim, d, bias=c.attention_bias, dtype=dtype, rngs=rngs)

    @property
    def page_shapes(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Shapes of one latent page and one shared-key page: [block_size, 1, R], [block_size, 1, Dr]."""
        return (self.block_size, 1, self.kv_lora_rank), (self.block_size, 1, self.rope_dim)

    def _project(self, x):
        """x [T, d_model] -> (q [T, H, Dn + Dr], latent [T, R] normed, k_rope [T, Dr])."""
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        latent, k_rope = jnp.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
        return q.reshape(x.shape[0], self.num_heads, -1), self.kv_a_layernorm(latent), k_rope

    def _kv_b(self):  # -> (W_uk [H, Dn, R], W_uv [H, Dv, R])
        w = self.kv_b_proj.weight[...].reshape(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    @jax.named_scope("kimi_linear_mla")
    def __call__(self, x, meta: StepMetadata, pools):
        """x [T, d_model] packed rows; pools (latent_pages, rope_pages). Returns (out [T, d_model], pools)."""
        q, latent, k_rope = self._project(x)
        w_uk, w_uv = self._kv_b()
        q32 = q.astype(jnp.float32) * self.scale
        q_latent = jnp.einsum("thn,hnr->thr", q32[..., :self.nope_dim], w_uk.astype(jnp.float32),
                              precision=_HIGHEST)  # [T, H, R]
        out, pools = paged_latent_attention(q_latent, q32[..., self.nope_dim:], latent, k_rope, meta, pools,
                                            block_size=self.block_size)
        out = jnp.einsum("thr,hvr->thv", out, w_uv.astype(jnp.float32), precision=_HIGHEST)  # [T, H, Dv]
        return self.o_proj(out.reshape(x.shape[0], -1).astype(x.dtype)), pools

    def reference(self, x, *, implementation=None):
        """One whole sequence x [T, d_model], no cache: keys and values expanded per head (transformers' form), dense
        causal attention."""
        num_tokens = x.shape[0]
        q, latent, k_rope = self._project(x)
        kv = self.kv_b_proj(latent).reshape(num_tokens, self.num_heads, -1)
        k_nope, v = jnp.split(kv, [self.nope_dim], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, None], (*k_nope.shape[:2], self.rope_dim))], -1)
        q = (q.astype(jnp.float32) * self.scale)[:, :, None]  # [T, H, 1, Dn + Dr]
        out = causal_attention(q, k, v)
        return self.o_proj(out.reshape(num_tokens, -1).astype(x.dtype))


class KimiLinearTopkRouter(nnx.Module):
    """DeepSeek-V3 routing in fp32: scores sigmoid(weight x); the n_group groups ranked by the sum of their top-2
    scores + e_score_correction_bias, the best topk_group kept; the top-k experts of those by score + bias; weights
    the plain scores, renormalized when norm_topk_prob, times routed_scaling_factor. weight [E, d_model] and
    e_score_correction_bias [E] stay fp32 in every model dtype (transformers keeps them so)."""

    def __init__(self, config: KimiLinearConfig, *, rngs: nnx.Rngs):
        c = config
        self.top_k, self.num_group, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = c.norm_topk_prob, c.routed_scaling_factor
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (c.num_local_experts, c.hidden_size))
                                * c.hidden_size ** -0.5)
        self.e_score_correction_bias = nnx.Param(jnp.zeros(c.num_local_experts, jnp.float32))

    def __call__(self, x):
        """x [T, d_model] -> (weights fp32 [T, k], experts i32[T, k])."""
        num_tokens, num_experts = x.shape[0], self.weight.shape[0]
        logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), self.weight[...], precision=_HIGHEST)
        scores = jax.nn.sigmoid(logits)
        choice = scores + self.e_score_correction_bias[...]
        grouped = choice.reshape(num_tokens, self.num_group, num_experts // self.num_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)  # [T, G]
        _, best_groups = jax.lax.top_k(group_scores, self.topk_group)
        keep = jnp.zeros_like(group_scores, bool).at[jnp.arange(num_tokens)[:, None], best_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, num_experts // self.num_group, axis=-1), choice, -jnp.inf)
        _, indices = jax.lax.top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices


class KimiLinearMoE(nnx.Module):
    """`gate` (the router) over the stacked `experts`, plus `shared_experts` (one SwiGLU of width
    moe_intermediate_size * n_shared_experts)."""

    def __init__(self, config: KimiLinearConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.gate = KimiLinearTopkRouter(c, rngs=rngs)
        self.experts = Experts(c.num_local_experts, c.hidden_size, c.moe_intermediate_size, dtype=dtype, rngs=rngs)
        self.shared_experts = SwiGLUMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, dtype=dtype,
                                        rngs=rngs)

    def route(self, x):
        return self.gate(x)

    def __call__(self, x):  # [T, d_model]
        return self.experts(x, *self.gate(x)) + self.shared_experts(x)


class KimiLinearDecoderLayer(DecoderLayer):
    """x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)); `self_attn` is KDA or MLA."""

    def __init__(self, config: KimiLinearConfig, index: int, *, rngs: nnx.Rngs):
        c = config
        dtype = jnp.dtype(c.dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        if c.layer_types[index] == "linear_attention":
            self.self_attn = KimiDeltaAttention(
                c.hidden_size, num_heads=c.linear_num_heads, head_dim=c.linear_head_dim,
                conv_width=c.linear_conv_kernel_dim, norm_eps=c.rms_norm_eps, chunk_size=c.chunk_size, dtype=dtype,
                implementation=c.implementation, rngs=rngs)
        else:
            self.self_attn = KimiLinearAttention(c, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        if c.mlp_layer_types[index] == "sparse":
            self.mlp = KimiLinearMoE(c, dtype=dtype, rngs=rngs)
        else:
            self.mlp = SwiGLUMLP(c.hidden_size, c.intermediate_size, dtype=dtype, rngs=rngs)

    @property
    def mixer(self):
        return self.self_attn


class KimiLinearModel(DecoderModel):
    layer_class = KimiLinearDecoderLayer
    norm_class = RMSNorm


class KimiLinearForCausalLM(CausalLM):
    """Kimi-Linear LM over paged caches (`common.CausalLM`: called as `HybridModel` is; `from_pretrained` reads a
    Hugging Face folder). `from_params` takes the files' names (`block_sparse_moe`, `q_conv1d`, `experts.{e}.w1`,
    ...) or transformers' in-memory state dict (`mlp`, `forget_gate`, the fused `conv1d` and experts)."""

    config_class = KimiLinearConfig
    model_class = KimiLinearModel

    @classmethod
    def checkpoint_params(cls, config: KimiLinearConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """transformers' names renamed to the files', its fused KDA conv split into q / k / v, experts stacked."""
        params = rename_params(params, _RENAMES)
        for i, kind in enumerate(config.kinds):
            prefix = f"model.layers.{i}"
            fused = params.pop(f"{prefix}.self_attn.conv1d.weight", None)
            if kind == "kda" and fused is not None:  # [3HD, 1, W] = [q | k | v]
                for name, part in zip(("q", "k", "v"), np.split(np.asarray(fused), 3)):
                    params[f"{prefix}.self_attn.{name}_conv1d.weight"] = part
            if config.mlp_layer_types[i] == "sparse":
                stack_experts(params, f"{prefix}.mlp", config.num_local_experts, names=("w1", "w3", "w2"))
        return params
