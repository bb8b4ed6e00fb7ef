"""Pieces the published-architecture models share: reading a Hugging Face model folder (config.json, sharded
safetensors by the index's own names), the zero-centred RMSNorm, the SwiGLU MLP, grouped-matmul MoE experts, cache
allocation, and the conversion of a request's state between our pools and transformers' cache layout.

Nothing here imports torch; `hf_dynamic_cache` / `from_hf_cache` import transformers lazily, for callers who hand
states to or take them from transformers' own models.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import struct
from collections.abc import Mapping, Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxckpt.layers import Linear, StepMetadata, load_params, validate_step
from jaxckpt.layers.metadata import check_pool_sizes
from jaxckpt.ops.grouped_matmul import grouped_matmul
from jaxckpt.plan.rules import model_checkpoint_alignment

_HIGHEST = jax.lax.Precision.HIGHEST
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                       "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                       "BOOL": np.bool_}


def _rms(x, eps: float):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def read_config(local_dir: str | os.PathLike) -> dict:
    """The folder's config.json as a dict."""
    path = os.path.join(local_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"local_dir: no config.json in {os.fspath(local_dir)!r}")
    with open(path) as f:
        return json.load(f)


def _read_safetensors_file(path: str) -> dict[str, np.ndarray]:
    """One .safetensors file memory-mapped into numpy arrays (bf16 as ml_dtypes.bfloat16, which numpy's loader in
    the safetensors package does not read)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    arrays = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"local_dir: tensor {name!r} in {path!r} has dtype {info['dtype']}, not one of "
                             f"{sorted(_SAFETENSORS_DTYPES)}")
        begin, end = info["data_offsets"]
        arrays[name] = data[begin:end].view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
    return arrays


def read_safetensors(local_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a model folder by its file name: the shards listed in model.safetensors.index.json, or the one
    model.safetensors. Arrays are memory-mapped (read-only); a name in two shards raises ValueError."""
    local_dir = os.fspath(local_dir)
    index = os.path.join(local_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(local_dir, "model.safetensors")):
        weight_map, files = None, ["model.safetensors"]
    else:
        raise ValueError(f"local_dir: neither model.safetensors.index.json nor model.safetensors in {local_dir!r}")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        for name, array in _read_safetensors_file(os.path.join(local_dir, file)).items():
            if name in tensors:
                raise ValueError(f"local_dir: tensor {name!r} appears in two shards")
            tensors[name] = array
    if weight_map is not None and set(weight_map) != set(tensors):
        missing = sorted(set(weight_map) - set(tensors))[:5]
        raise ValueError(f"local_dir: the index names tensors its shards lack, e.g. {missing}")
    return tensors


def config_dtype(hf_config: Mapping, dtype: str | None) -> str:
    """The dtype a model is built in: `dtype` when given, else config.json's `dtype` / `torch_dtype`, else fp32."""
    name = dtype or hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: must be float32, bfloat16 or float16, got {name!r}")
    return name


def check_max_model_len(max_model_len: int, block_size: int) -> None:
    """ValueError unless a sequence of max_model_len tokens fills whole KV pages."""
    if max_model_len % block_size:
        raise ValueError(f"max_model_len: must be a multiple of block_size={block_size}, got {max_model_len}")


def default_rope(hf: Mapping) -> dict:
    """config.json's `rope_parameters` (empty when absent); ValueError for any RoPE but the default one."""
    rope_parameters = dict(hf.get("rope_parameters") or {})
    if rope_parameters.get("rope_type", "default") != "default":
        raise ValueError(f"config: only the default RoPE is supported, got rope_type {rope_parameters['rope_type']!r}")
    return rope_parameters


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishedConfig:
    """What the published models' configs share: the vocabulary, the width, `layer_types` (config.json's names,
    `layer_kinds` maps them to our cache kinds), tied embeddings, and the serving sizes of our caches; all
    keyword-only. Subclasses are frozen dataclasses of transformers' config names; they set `model_type` and
    `layer_kinds` and give `derived_fields`, and `from_hf` reads config.json's dict."""

    model_type: ClassVar[str]
    layer_kinds: ClassVar[Mapping[str, str]]   # config.json layer type -> our cache kind
    hf_aliases: ClassVar[Mapping[str, str]] = {}  # config.json names transformers maps to other attributes

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    tie_word_embeddings: bool = False
    # serving: KV page size, longest sequence, chunk of the recurrent ops, compute dtype, jaxckpt.ops implementation,
    # paged attention ("xla" or "pallas_triton"; None: `jaxckpt.layers.attention.choose_attention`)
    block_size: int = 16
    max_model_len: int = 4096
    chunk_size: int = 64
    dtype: str = "float32"
    implementation: str | None = None
    attention_implementation: str | None = None

    def __post_init__(self):
        bad = [t for t in self.layer_types if t not in self.layer_kinds]
        if bad or not self.layer_types:
            raise ValueError(f"layer_types: must be a non-empty list of {sorted(self.layer_kinds)}, got "
                             f"{list(self.layer_types)}")
        check_max_model_len(self.max_model_len, self.block_size)

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Our cache kind of each layer, `jaxckpt.models.hybrid.Caches.layer_types`."""
        return tuple(self.layer_kinds[t] for t in self.layer_types)

    @classmethod
    def from_hf(cls, hf: Mapping, **serving):
        """From config.json's dict; `serving` sets block_size, max_model_len, chunk_size, dtype, implementation,
        attention_implementation."""
        if hf.get("model_type") != cls.model_type:
            raise ValueError(f"config: model_type must be {cls.model_type!r}, got {hf.get('model_type')!r}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config: hidden_act must be 'silu', got {hf['hidden_act']!r}")
        hf = {cls.hf_aliases.get(k, k): v for k, v in hf.items()}
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in hf.items() if k in fields} | cls.derived_fields(hf)
        layers = hf.get("num_hidden_layers")
        if layers is not None and len(values["layer_types"]) != layers:
            raise ValueError(f"config: {len(values['layer_types'])} layer_types for num_hidden_layers={layers}")
        return cls(**(values | serving))

    @classmethod
    def derived_fields(cls, hf: Mapping) -> dict:
        """The fields config.json gives in another form (at least `layer_types`), and its checks of what the model
        cannot run; `hf` with `hf_aliases` applied."""
        raise NotImplementedError


class ZeroCenteredRMSNorm(nnx.Module):
    """x / rms(x) * (1 + weight) in fp32, cast back (Qwen3-Next's RMSNorm); weight [dim] starts at zeros."""

    def __init__(self, dim: int, *, eps: float, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.zeros(dim, dtype))

    def __call__(self, x):  # [..., dim]
        return (_rms(x.astype(jnp.float32), self.eps) * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class SwiGLUMLP(nnx.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)); names as transformers' `*MLP`."""

    def __init__(self, d_model: int, d_ff: int, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(d_model, d_ff, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d_model, d_ff, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(d_ff, d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x):  # [T, d_model]
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nnx.Module):
    """E SwiGLU experts of width I as two grouped matmuls (`jaxckpt.ops.grouped_matmul`: a Pallas kernel on the GPU,
    where XLA's ragged_dot would expand to every pair times every expert) over the token-expert pairs sorted by
    expert.

    gate_up_proj [E, d_model, 2I] ([gate | up] on the last axis), down_proj [E, I, d_model]: [in, out] per expert,
    the layout a grouped matmul takes. Checkpoints name the experts one by one (`experts.{e}.gate_proj.weight` [I, d_model],
    ...) or fused in transformers' memory layout (`experts.gate_up_proj` [E, 2I, d_model]); `stack_experts`
    converts either.
    """

    def __init__(self, num_experts: int, d_model: int, d_ff: int, *, dtype, rngs: nnx.Rngs):
        self.num_experts, self.d_ff = num_experts, d_ff
        self.gate_up_proj = nnx.Param((jax.random.normal(rngs.params(), (num_experts, d_model, 2 * d_ff))
                                       * d_model ** -0.5).astype(dtype))
        self.down_proj = nnx.Param((jax.random.normal(rngs.params(), (num_experts, d_ff, d_model))
                                    * d_ff ** -0.5).astype(dtype))

    def __call__(self, x, weights, indices):
        """x [T, d_model]; weights [T, k] routing weights, indices i32[T, k] experts -> [T, d_model]. Pairs whose
        expert lies outside [0, E) add nothing (under expert sharding they are other shards' experts)."""
        num_tokens, top_k = indices.shape
        flat = indices.reshape(-1)                                    # [T * k]
        mine = (flat >= 0) & (flat < self.num_experts)
        flat = jnp.where(mine, flat, self.num_experts)
        order = jnp.argsort(flat, stable=True)                        # pairs grouped by expert, tokens ascending
        token_of = order // top_k
        sizes = jnp.bincount(flat, length=self.num_experts + 1)[:-1].astype(jnp.int32)  # i32[E]
        precision = _HIGHEST if x.dtype == jnp.float32 else None
        gate_up = grouped_matmul(x[token_of], self.gate_up_proj[...], sizes, precision=precision,
                                 preferred_element_type=x.dtype)  # [T * k, 2I]
        gate, up = jnp.split(gate_up, 2, axis=-1)
        hidden = jax.nn.silu(gate) * up
        out = grouped_matmul(hidden, self.down_proj[...], sizes, precision=precision,
                             preferred_element_type=x.dtype)  # [T * k, d_model]
        # the dropped pairs sort last, past every group
        out = jnp.where(mine[order][:, None], out * weights.reshape(-1)[order][:, None].astype(x.dtype), 0)
        # each token's pairs by their places in `order`, ascending: its experts in ascending order, summed one by one
        # in x.dtype as transformers' index_add does; a gather, not a scatter-add of the [T * k, d_model] pairs, which
        # is slow on GPUs and sums in no fixed order (jaxckpt/models/README.md, "GPU: Qwen3-Next prefill")
        num_pairs = num_tokens * top_k
        place = jnp.zeros(num_pairs, jnp.int32).at[order].set(jnp.arange(num_pairs, dtype=jnp.int32),
                                                               unique_indices=True)
        pairs = out[jnp.sort(place.reshape(num_tokens, top_k), axis=1)]  # [T, k, d_model]
        total = pairs[:, 0]
        for j in range(1, top_k):
            total = total + pairs[:, j]
        return total


def stack_experts(params: dict[str, np.ndarray], prefix: str, num_experts: int, *,
                  names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
    """Rewrites `{prefix}.experts.*` of a checkpoint in place into `Experts`' gate_up_proj / down_proj.

    Reads the experts one by one (`{prefix}.experts.{e}.{gate}.weight` [I, d_model], `{up}`, `{down}` [d_model, I],
    `names` = (gate, up, down): Mixtral-style files say ("w1", "w3", "w2")) or fused in transformers' memory layout
    (`{prefix}.experts.gate_up_proj` [E, 2I, d_model], `{prefix}.experts.down_proj` [E, d_model, I])."""
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in params:
        gate_up = np.asarray(params.pop(fused))        # [E, 2I, d_model]
        down = np.asarray(params.pop(f"{prefix}.experts.down_proj"))  # [E, d_model, I]
    else:
        gate, up, down_name = names
        per_expert = [tuple(f"{prefix}.experts.{e}.{n}.weight" for n in (gate, up, down_name))
                      for e in range(num_experts)]
        missing = [n for group in per_expert for n in group if n not in params]
        if missing:
            raise ValueError(f"params: missing expert weights, e.g. {missing[:3]}")
        gate_up = np.stack([np.concatenate([params.pop(g), params.pop(u)]) for g, u, _ in per_expert])
        down = np.stack([params.pop(d) for _, _, d in per_expert])
    if gate_up.shape[0] != num_experts:
        raise ValueError(f"params: {prefix}.experts holds {gate_up.shape[0]} experts, the config {num_experts}")
    params[f"{prefix}.experts.gate_up_proj"] = np.swapaxes(gate_up, 1, 2)
    params[f"{prefix}.experts.down_proj"] = np.swapaxes(down, 1, 2)


def rename_params(params: Mapping[str, np.ndarray], renames: Sequence[tuple[str, str]]) -> dict[str, np.ndarray]:
    """{name: array} with each (pattern, replacement) regex substitution applied to every name, in order."""
    out = {}
    for name, array in params.items():
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name)
        if name in out:
            raise ValueError(f"params: two tensors map to {name!r}")
        out[name] = array
    return out


def build_model(cls, config, params: Mapping[str, np.ndarray]):
    """`cls(config)` built abstract (`nnx.eval_shape`), each parameter allocated once from `params` (strict)."""
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    load_params(model, params)
    return model


def init_caches(mixers: Sequence[nnx.Module], layer_types: tuple[str, ...], num_kv_pages: int,
                num_state_slots: int, *, kv_dtype, fill: float = 0.0):
    """`jaxckpt.models.hybrid.Caches` for a stack of mixers: attention layers get KV pages [num_kv_pages, *page] in
    `kv_dtype` (`page_shapes`, one per pool, or one `page_shape` for both K and V), recurrent layers (`state_shapes`)
    fp32 pools [num_state_slots, *shape]. Page 0 and slot 0 are null; `fill=nan` poisons them for tests."""
    from jaxckpt.models.hybrid import Caches

    check_pool_sizes(num_kv_pages, num_state_slots)
    layers = []
    for mixer, layer_type in zip(mixers, layer_types):
        if layer_type == "attention":
            shapes = getattr(mixer, "page_shapes", None) or (mixer.page_shape,) * 2
            layers.append(tuple(jnp.full((num_kv_pages, *shape), fill, kv_dtype) for shape in shapes))
        else:
            layers.append(tuple(jnp.full((num_state_slots, *shape), fill, jnp.float32)
                                for shape in mixer.state_shapes))
    return Caches(tuple(layers), layer_types)


def whole(y):
    """The `reduce` of one device: a block's partial sums are already the whole sum (`jaxckpt.models.sharded` passes
    a psum over the mesh axis instead)."""
    return y


class DecoderLayer(nnx.Module):
    """Pre-norm block of the published models: x + r * mixer(input_layernorm(x)), then
    x + r * feed_forward(post_attention_layernorm(x)), r = `residual_multiplier` (1 but in Granite). Subclasses set
    the two norms, a `mixer` property and `mlp` (or override `feed_forward`)."""

    residual_multiplier: float = 1.0

    def feed_forward(self, x):  # [T, d_model]
        return self.mlp(x)

    def __call__(self, x, meta: StepMetadata, pools, *, reduce=whole):
        """`reduce` sums the per-shard partial outputs of the mixer and the MLP under sharding."""
        mixed, pools = self.mixer(self.input_layernorm(x), meta, pools)
        x = x + reduce(mixed) * self.residual_multiplier
        return x + reduce(self.feed_forward(self.post_attention_layernorm(x))) * self.residual_multiplier, pools

    def reference(self, x, *, implementation):
        x = x + self.mixer.reference(self.input_layernorm(x), implementation=implementation) * self.residual_multiplier
        return x + self.feed_forward(self.post_attention_layernorm(x)) * self.residual_multiplier


class Embedding(nnx.Module):
    """weight [vocab, d_model] rows looked up by token id; N(0, 1) so the first pre-norm sees O(1) inputs."""

    def __init__(self, vocab_size: int, d_model: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab_size, d_model)).astype(dtype))

    def __call__(self, tokens):  # i32[T] -> [T, d_model]
        return self.weight[...][tokens]


class DecoderModel(nnx.Module):
    """transformers' `*Model` of a published LM: `embed_tokens`, `layers` (`layer_class(config, i)` each) and the
    final `norm` (`norm_class`); subclasses set the two classes."""

    layer_class: ClassVar[type[DecoderLayer]]
    norm_class: ClassVar[type[nnx.Module]]

    def __init__(self, config: PublishedConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([self.layer_class(config, i, rngs=rngs) for i in range(config.num_hidden_layers)])
        self.norm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)


class CausalLM(nnx.Module):
    """What the published LMs share over paged caches, called as `HybridModel` is (so `hybrid.forward`,
    `HybridRunner` and the engine run them): `model(tokens, meta, caches) -> (logits fp32 [N, vocab] of each row's
    last token, caches)`; `all_tokens=True` gives every token's logits [T, vocab].

    Subclasses set `config_class` (a `PublishedConfig`) and `model_class` (a `DecoderModel`), and override
    `checkpoint_params` where the files' names or layouts differ from the modules'; Granite overrides `embed` and
    `logits` for its multipliers. The module tree: `config`, `model`, `lm_head` unless the embeddings are tied.
    """

    config_class: ClassVar[type[PublishedConfig]]
    model_class: ClassVar[type[DecoderModel]]

    def __init__(self, config: PublishedConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = self.model_class(config, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype=jnp.dtype(config.dtype), rngs=rngs)

    @classmethod
    def from_pretrained(cls, local_dir: str | os.PathLike, *, dtype: str | None = None, **serving):
        """Loads a Hugging Face folder of this architecture (config.json, model.safetensors[.index.json]) by the
        files' own names, in `dtype` (default: the config's). `serving`: block_size, max_model_len, chunk_size,
        implementation."""
        return cls.from_params(read_config(local_dir), read_safetensors(local_dir), dtype=dtype, **serving)

    @classmethod
    def from_params(cls, hf_config: Mapping, params: Mapping[str, np.ndarray], *, dtype: str | None = None,
                    **serving):
        """As `from_pretrained`, from config.json's dict and {checkpoint name: array} (the files' names, or
        transformers' in-memory state dict). The model is built abstract and each parameter allocated once, from
        `params`."""
        config = cls.config_class.from_hf(hf_config, dtype=config_dtype(hf_config, dtype), **serving)
        params = cls.checkpoint_params(config, dict(params))
        if config.tie_word_embeddings:
            params.pop("lm_head.weight", None)
        return build_model(cls, config, params)

    @classmethod
    def checkpoint_params(cls, config: PublishedConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A checkpoint's {name: array} (a copy, free to change) under the module tree's names and layouts."""
        return params

    @property
    def mixers(self) -> list[nnx.Module]:
        return [layer.mixer for layer in self.model.layers]

    def checkpoint_alignment(self) -> int | None:
        """Token alignment every recurrent layer's checkpoints need (1: any offset), by `jaxckpt.plan`'s rule."""
        return model_checkpoint_alignment(m.get_prefill_checkpoint_alignment() for m, kind in
                                          zip(self.mixers, self.config.kinds) if kind != "attention")

    def init_caches(self, num_kv_pages: int, num_state_slots: int, *, fill: float = 0.0):
        """KV pages [num_kv_pages, *page] in the model dtype, fp32 recurrent pools; page 0 / slot 0 null."""
        return init_caches(self.mixers, self.config.kinds, num_kv_pages, num_state_slots,
                           kv_dtype=jnp.dtype(self.config.dtype), fill=fill)

    def embed(self, tokens):  # i32[T] -> [T, d_model]
        return self.model.embed_tokens(tokens)

    def logits(self, hidden):  # [..., d_model] after the final norm -> fp32 [..., vocab]
        if self.config.tie_word_embeddings:
            return jnp.einsum("...d,vd->...v", hidden, self.model.embed_tokens.weight[...], precision=_HIGHEST,
                              preferred_element_type=jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def __call__(self, tokens, meta: StepMetadata, caches, *, all_tokens: bool = False, reduce=whole):
        """tokens i32[T] packed as meta.cu_seqlens -> (logits, caches); pure (donate the caches through
        `forward`). Rows and tokens past the real batch give garbage. `reduce`: see `DecoderLayer`."""
        from jaxckpt.models.hybrid import Caches

        x = self.embed(tokens)
        layers = []
        for layer, pools in zip(self.model.layers, caches.layers):
            x, pools = layer(x, meta, pools, reduce=reduce)
            layers.append(pools)
        if not all_tokens:
            x = x[jnp.maximum(meta.cu_seqlens[1:] - 1, 0)]
        return self.logits(self.model.norm(x)), Caches(tuple(layers), caches.layer_types)

    def reference_logits(self, tokens, *, implementation: str | None = "reference"):
        """Per-token logits fp32 [T, vocab] of one prompt from a fresh state, no caches (float64 recurrent ops by
        default): the oracle of the paged path."""
        x = self.embed(jnp.asarray(tokens, jnp.int32))
        for layer in self.model.layers:
            x = layer.reference(x, implementation=implementation)
        return self.logits(self.model.norm(x))


def export_state(caches, *, slot: int, pages: Sequence[int], num_tokens: int, block_size: int) -> list[dict]:
    """One request's state at `num_tokens` tokens in transformers' cache layout, as numpy arrays per layer.

    Recurrent layers: `conv` [D, W] (transformers keeps the last W conv inputs, we keep W - 1: the oldest column,
    which no later step reads, is zero) and `recurrent` (the pool's slot, same layout). Attention layers: `keys`
    [Hkv, num_tokens, Dk], `values` [Hkv, num_tokens, Dv] gathered from `pages` (the request's block table).
    """
    if len(pages) * block_size < num_tokens:
        raise ValueError(f"pages: {len(pages)} pages of {block_size} cannot hold {num_tokens} tokens")
    out = []
    for layer_type, pools in zip(caches.layer_types, caches.layers):
        if layer_type == "attention":
            used = np.asarray(pages[:-(-num_tokens // block_size)], np.int64)
            keys, values = (np.asarray(p)[used].reshape(-1, *p.shape[2:])[:num_tokens] for p in pools)
            out.append({"keys": np.swapaxes(keys, 0, 1), "values": np.swapaxes(values, 0, 1)})
        else:
            conv = np.asarray(pools[0][slot])
            out.append({"conv": np.concatenate([np.zeros_like(conv[:, :1]), conv], axis=1),
                        "recurrent": np.asarray(pools[1][slot])})
    return out


def import_state(caches, layers: Sequence[Mapping[str, np.ndarray]], *, slot: int, pages: Sequence[int],
                 block_size: int):
    """The inverse of `export_state`: writes a request's state (transformers' layout) into `slot` of every recurrent
    pool and into `pages` of every KV pool; returns new caches. Resume it with context_lens = the token count,
    initial_state_indices = slot, and the same pages first in the block table."""
    from jaxckpt.models.hybrid import Caches

    if len(layers) != len(caches.layers):
        raise ValueError(f"layers: {len(layers)} layer states for a model of {len(caches.layers)} layers")
    new = []
    for i, (layer_type, pools, state) in enumerate(zip(caches.layer_types, caches.layers, layers)):
        if layer_type == "attention":
            num_tokens = state["keys"].shape[1]
            need = -(-num_tokens // block_size)
            if len(pages) < need:
                raise ValueError(f"pages: {num_tokens} tokens need {need} pages of {block_size}, got {len(pages)}")
            used = jnp.asarray(np.asarray(pages[:need], np.int32))
            written = []
            for pool, array in zip(pools, (state["keys"], state["values"])):
                tokens = np.swapaxes(np.asarray(array), 0, 1)  # [T, Hkv, D]
                padded = np.zeros((need * block_size, *tokens.shape[1:]), tokens.dtype)
                padded[:num_tokens] = tokens
                written.append(pool.at[used].set(jnp.asarray(padded.reshape(need, block_size, *tokens.shape[1:]),
                                                             pool.dtype)))
            new.append(tuple(written))
        else:
            conv, recurrent = np.asarray(state["conv"]), np.asarray(state["recurrent"])
            width = pools[0].shape[-1]
            if conv.shape[-1] < width:
                raise ValueError(f"layers: layer {i}'s conv state holds {conv.shape[-1]} columns, needs {width}")
            new.append((pools[0].at[slot].set(jnp.asarray(conv[:, -width:], pools[0].dtype)),
                        pools[1].at[slot].set(jnp.asarray(recurrent, pools[1].dtype))))
    return Caches(tuple(new), caches.layer_types)


def hf_dynamic_cache(hf_config, layers: Sequence[Mapping[str, np.ndarray]]):
    """A transformers `DynamicCache` (batch 1) holding `export_state`'s layers, for transformers' own model to resume
    from. Imports torch and transformers."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_config)
    for i, state in enumerate(layers):
        layer = cache.layers[i]
        if "keys" in state:
            layer.update(torch.from_numpy(np.array(state["keys"]))[None],
                         torch.from_numpy(np.array(state["values"]))[None])
        else:
            layer.update_conv_state(torch.from_numpy(np.array(state["conv"]))[None])
            layer.update_recurrent_state(torch.from_numpy(np.array(state["recurrent"]))[None])
    return cache


def from_hf_cache(cache, *, batch_index: int = 0) -> list[dict]:
    """One row of a transformers cache as `import_state`'s layers (numpy, fp32 states)."""
    layers = []
    for layer in cache.layers:
        if getattr(layer, "conv_states", None) and layer.conv_states.get(0) is not None:
            layers.append({"conv": layer.conv_states[0][batch_index].float().numpy(),
                           "recurrent": layer.recurrent_states[0][batch_index].float().numpy()})
        else:
            layers.append({"keys": layer.keys[batch_index].float().numpy(),
                           "values": layer.values[batch_index].float().numpy()})
    return layers


@functools.partial(jax.jit, static_argnames=("all_tokens",), donate_argnames=("caches",))
def _forward(graphdef, state, tokens, meta, caches, all_tokens):
    return nnx.merge(graphdef, state)(tokens, meta, caches, all_tokens=all_tokens)


def forward(graphdef, state, tokens, meta, caches, *, all_tokens: bool = False):
    """Jitted step of a published-architecture model (`graphdef, state = nnx.split(model)`), caches donated:
    (logits fp32 [N, vocab] of each row's last token, or [T, vocab] of every token with `all_tokens`, caches).
    Concrete metadata is checked against the caches first, as `jaxckpt.models.hybrid.forward` does."""
    validate_step(tokens, meta, num_state_slots=caches.num_state_slots, num_kv_pages=caches.num_kv_pages)
    return _forward(graphdef, state, tokens, meta, caches, all_tokens)
