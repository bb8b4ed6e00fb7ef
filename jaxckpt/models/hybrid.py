"""A hybrid language model of attention and recurrent layers (Mamba2, Gated DeltaNet, KDA) over paged caches.

Pre-norm residual blocks (RMSNorm -> mixer -> residual; RMSNorm -> SwiGLU MLP -> residual), a final RMSNorm and an LM
head. One call is one engine step over packed rows: tokens and `StepMetadata` in, the logits of each row's last
token and the new caches out. Every recurrent layer reads and writes the same state slots, so a slot is the whole
recurrent state of a request (all layers) at one point, and a checkpoint slot plus the KV pages up to that point
resume a request exactly.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.layers import (Attention, GatedDeltaNet, KimiDeltaAttention, Linear, Mamba2Mixer, RMSNorm, StepMetadata,
                            validate_step)
from jaxckpt.models.common import DecoderLayer, Embedding, check_max_model_len, whole
from jaxckpt.models.common import SwiGLUMLP as SwiGLU
from jaxckpt.plan.rules import model_checkpoint_alignment

LAYER_TYPES = ("attention", "gdn", "mamba2", "kda")


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Sizes of a HybridModel; `tiny()` for CPU tests and demos, `bench()` for a Qwen3-Next-like GPU model."""

    vocab_size: int
    d_model: int
    layer_types: tuple[str, ...]
    # attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # gated delta net
    gdn_num_k_heads: int
    gdn_num_v_heads: int
    gdn_head_k_dim: int
    gdn_head_v_dim: int
    # mamba2
    mamba_num_heads: int
    mamba_head_dim: int
    mamba_d_state: int
    mamba_n_groups: int
    # kda
    kda_num_heads: int
    kda_head_dim: int
    conv_width: int = 4
    mlp_ratio: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    block_size: int = 16
    max_model_len: int = 4096
    chunk_size: int = 64
    dtype: str = "float32"
    implementation: str | None = None
    attention_implementation: str | None = None  # paged attention: "xla", "pallas_triton" or None (choose_attention)

    def __post_init__(self):
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad or not self.layer_types:
            raise ValueError(f"layer_types: must be a non-empty tuple of {LAYER_TYPES}, got {self.layer_types!r}")
        check_max_model_len(self.max_model_len, self.block_size)

    @property
    def d_ff(self) -> int:
        return self.mlp_ratio * self.d_model

    @property
    def max_blocks(self) -> int:
        """KV pages one sequence of max_model_len tokens needs."""
        return self.max_model_len // self.block_size

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t != "attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "attention")

    @classmethod
    def tiny(cls, **overrides) -> HybridConfig:
        """Byte vocabulary, one layer of each type, small widths, fp32, the portable "xla" ops (CPU)."""
        fields = dict(vocab_size=256, d_model=32, layer_types=("gdn", "mamba2", "attention", "kda"), num_heads=4,
                      num_kv_heads=2, head_dim=16, gdn_num_k_heads=2, gdn_num_v_heads=4, gdn_head_k_dim=16,
                      gdn_head_v_dim=16, mamba_num_heads=4, mamba_head_dim=16, mamba_d_state=16, mamba_n_groups=1,
                      kda_num_heads=2, kda_head_dim=16, block_size=8, max_model_len=256, chunk_size=16,
                      dtype="float32", implementation="xla")
        return cls(**(fields | overrides))

    @classmethod
    def tiny_sharded(cls, **overrides) -> HybridConfig:
        """`tiny()` with every head count (and the MLP width) a multiple of 8, so meshes of 1, 2, 4 and 8 devices
        shard it by head (`jaxckpt.models.sharded`); Mamba2 has 2 groups, split over 1 or 2 devices and shared by
        the shards of a group over 4 or 8."""
        fields = dict(num_heads=8, num_kv_heads=8, head_dim=8, gdn_num_k_heads=8, gdn_num_v_heads=16,
                      gdn_head_k_dim=8, gdn_head_v_dim=8, mamba_num_heads=8, mamba_head_dim=8, mamba_d_state=8,
                      mamba_n_groups=2, kda_num_heads=8, kda_head_dim=8)
        return cls.tiny(**(fields | overrides))

    @classmethod
    def bench(cls, **overrides) -> HybridConfig:
        """Qwen3-Next-like: d_model 2048, GDN 16 key / 32 value heads of 128, one attention per three GDN, bf16."""
        fields = dict(vocab_size=32768, d_model=2048, layer_types=("gdn", "gdn", "gdn", "attention") * 2,
                      num_heads=16, num_kv_heads=2, head_dim=128, gdn_num_k_heads=16, gdn_num_v_heads=32,
                      gdn_head_k_dim=128, gdn_head_v_dim=128, mamba_num_heads=64, mamba_head_dim=64,
                      mamba_d_state=128, mamba_n_groups=1, kda_num_heads=16, kda_head_dim=128, block_size=16,
                      max_model_len=32768, chunk_size=64, rope_theta=1e6, dtype="bfloat16", implementation=None)
        return cls(**(fields | overrides))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["layers"], meta_fields=["layer_types"])
@dataclasses.dataclass(frozen=True)
class Caches:
    """Per-layer caches: (k_pages, v_pages) [P, block_size, Hkv, D] for attention, (conv_pool [S, conv_dim, W - 1],
    recurrent_pool [S, ...]) fp32 for recurrent layers. Page 0 and slot 0 are null."""

    layers: tuple[tuple[jax.Array, jax.Array], ...]
    layer_types: tuple[str, ...]

    @property
    def num_state_slots(self) -> int | None:
        sizes = [pools[0].shape[0] for pools, t in zip(self.layers, self.layer_types) if t != "attention"]
        return sizes[0] if sizes else None

    @property
    def num_kv_pages(self) -> int | None:
        sizes = [pools[0].shape[0] for pools, t in zip(self.layers, self.layer_types) if t == "attention"]
        return sizes[0] if sizes else None


def _mixer(config: HybridConfig, layer_type: str, *, dtype, rngs: nnx.Rngs):
    c = config
    common = dict(chunk_size=c.chunk_size, dtype=dtype, implementation=c.implementation, rngs=rngs)
    if layer_type == "attention":
        return Attention(c.d_model, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                         block_size=c.block_size, rope_theta=c.rope_theta, implementation=c.attention_implementation,
                         dtype=dtype, rngs=rngs)
    if layer_type == "gdn":
        return GatedDeltaNet(c.d_model, num_k_heads=c.gdn_num_k_heads, num_v_heads=c.gdn_num_v_heads,
                             head_k_dim=c.gdn_head_k_dim, head_v_dim=c.gdn_head_v_dim, conv_width=c.conv_width,
                             norm_eps=c.rms_norm_eps, **common)
    if layer_type == "mamba2":
        return Mamba2Mixer(c.d_model, num_heads=c.mamba_num_heads, head_dim=c.mamba_head_dim,
                           d_state=c.mamba_d_state, n_groups=c.mamba_n_groups, conv_width=c.conv_width, **common)
    return KimiDeltaAttention(c.d_model, num_heads=c.kda_num_heads, head_dim=c.kda_head_dim, conv_width=c.conv_width,
                              **common)


class Block(DecoderLayer):
    """x + mixer(norm(x)), then x + mlp(norm(x)) (`common.DecoderLayer`)."""

    def __init__(self, config: HybridConfig, layer_type: str, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.input_layernorm = RMSNorm(config.d_model, eps=config.rms_norm_eps, dtype=dtype)
        self.mixer = _mixer(config, layer_type, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.d_model, eps=config.rms_norm_eps, dtype=dtype)
        self.mlp = SwiGLU(config.d_model, config.d_ff, dtype=dtype, rngs=rngs)


class HybridModel(nnx.Module):
    """The hybrid LM; parameter names `embed_tokens.weight`, `layers.{i}.{input_layernorm, mixer, ...}`, `norm.weight`,
    `lm_head.weight` (`jaxckpt.layers.param_dict` / `load_params`)."""

    def __init__(self, config: HybridConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Block(config, t, rngs=rngs) for t in config.layer_types])
        self.norm = RMSNorm(config.d_model, eps=config.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(config.d_model, config.vocab_size, dtype=dtype, rngs=rngs)

    def checkpoint_alignment(self) -> int | None:
        """Token alignment every recurrent layer's checkpoints need (1: any offset)."""
        return model_checkpoint_alignment(block.mixer.get_prefill_checkpoint_alignment() for block in self.layers
                                          if not isinstance(block.mixer, Attention))

    def init_caches(self, num_kv_pages: int, num_state_slots: int, *, fill: float = 0.0) -> Caches:
        """Empty caches: KV pools [num_kv_pages, block_size, Hkv, D] in the model dtype, state pools fp32.

        Page 0 and slot 0 are null (never read as real data, never written). `fill=nan` poisons them for tests.
        """
        from jaxckpt.models.common import init_caches

        return init_caches([block.mixer for block in self.layers], self.config.layer_types, num_kv_pages,
                           num_state_slots, kv_dtype=jnp.dtype(self.config.dtype), fill=fill)

    def __call__(self, tokens, meta: StepMetadata, caches: Caches, *, reduce=whole):
        """tokens i32[T] packed as meta.cu_seqlens; returns (logits fp32 [N, vocab] of each row's last token, caches).

        Pure: caches in, new caches out (donate them through `forward`). Rows past the real batch give garbage.
        `reduce`: see `Block` (set by `jaxckpt.models.sharded`).
        """
        x = self.embed_tokens(tokens)  # [T, d_model]
        new_layers = []
        for block, pools in zip(self.layers, caches.layers):
            x, pools = block(x, meta, pools, reduce=reduce)
            new_layers.append(pools)
        last = jnp.maximum(meta.cu_seqlens[1:] - 1, 0)  # [N]
        logits = self.lm_head(self.norm(x[last])).astype(jnp.float32)
        return logits, Caches(tuple(new_layers), caches.layer_types)

    def reference_logits(self, tokens, *, implementation: str | None = "reference"):
        """Per-token logits fp32 [T, vocab] of one prompt, uncached: all tokens at once from a fresh state.

        The parity oracle of `__call__`: dense causal attention, non-paged ops (float64 `reference` ones by default).
        """
        x = self.embed_tokens(jnp.asarray(tokens, jnp.int32))
        for block in self.layers:
            x = block.reference(x, implementation=implementation)
        return self.lm_head(self.norm(x)).astype(jnp.float32)


@functools.partial(jax.jit, donate_argnames=("caches",))
def _forward(graphdef, state, tokens, meta, caches):
    return nnx.merge(graphdef, state)(tokens, meta, caches)


def forward(graphdef, state, tokens, meta: StepMetadata, caches: Caches):
    """Jitted, caches donated: `graphdef, state = nnx.split(model)`; returns (logits [N, vocab], caches).

    Concrete metadata is checked against the caches first (slots and pages in range, token count), so a bad step
    raises ValueError instead of the device silently clamping or dropping indices.
    """
    validate_step(tokens, meta, num_state_slots=caches.num_state_slots, num_kv_pages=caches.num_kv_pages)
    return _forward(graphdef, state, tokens, meta, caches)
