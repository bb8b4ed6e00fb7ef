"""Head-sharded (tensor-parallel) hybrid model and layers over one axis of a `jax.sharding.Mesh`.

Megatron's layout, as one SPMD program: each mixer runs whole heads per shard, its in-projections split by output
(column parallel) and its out-projection by input (row parallel), one psum adding up the partial outputs; the SwiGLU
MLP splits its hidden width the same way; embeddings, norms and the LM head are replicated. State pools (recurrent
and conv) and KV pages are split on their head / channel axis. The step metadata (cu_seqlens, slots, checkpoint
lists, block tables) is replicated, so the plan, the prefix cache and the engine decide once for all shards, and a
forward writes every shard's part of a checkpoint slot before it returns.

The sharded layout. Where a global axis fuses several parts (GDN's conv channels [q | k | v], Mamba2's in_proj rows
[z | x | B | C | dt]), shard s holds [its part of q | its part of k | ...]: the global array is permuted so that an even
split of the axis hands every shard whole heads. A part several shards read (Mamba2's B / C when there are fewer
groups than shards) is repeated in each of them. `Split.indices[s]` lists the global positions shard s holds:

- GDN: in_proj_qkvz / in_proj_ba rows (grouped per key head already: contiguous), dt_bias, A_log, out_proj
  columns: its heads; conv1d.weight and conv pool channels: [q | k | v] of its heads (permuted).
- Mamba2: in_proj rows [z | x | B | C | dt] and conv1d weight / bias / conv pool channels [x | B | C] of its heads
  (permuted), B / C its groups or the one group its heads read; dt_bias, A_log, D, norm.weight, out_proj columns:
  its heads.
- KDA: q/k/v, f_b, g_b, b_proj rows, q/k/v conv weights, A_log, dt_bias, o_proj columns: its heads; conv pool
  channels [q | k | v] of its heads (permuted); f_a, g_a, o_norm replicated.
- Attention: q_proj rows, k_proj / v_proj rows, o_proj columns, KV pages (axis 2): its query heads and the KV heads
  they read.
- Every recurrent layer: the recurrent pool (axis 1) holds its (value) heads.

Each shard runs the single-device layer code on a local module with 1 / n of the heads (`local_mixer`), so the conv
and scan kernels (the paged ops, Pallas or XLA) run per shard under `jax.shard_map` and read and write only their
part of the pools: XLA cannot partition these custom kernels or the fused-channel reshapes, so the whole block runs
in the map with explicit psums. One exception to the unchanged layer code: when Mamba2's norm group spans shards
(fewer groups than shards), its mean of squares is a psum over the shards of the group (`GroupSpanningNorm`).

`check_vma=False`: the Pallas kernels do not declare varying manual axes on their outputs, which a checked
`shard_map` demands; the psums are the only collectives, so nothing depends on the check.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt.layers import Attention, GatedDeltaNet, KimiDeltaAttention, Mamba2Mixer, StepMetadata, validate_step
from jaxckpt.models.common import Experts
from jaxckpt.models.hybrid import Caches, HybridConfig, HybridModel, SwiGLU

AXIS = "heads"


def head_mesh(num_devices: int, *, axis: str = AXIS) -> Mesh:
    """A 1-D mesh over the first `num_devices` devices of the default backend (the first N GPUs on a GPU host)."""
    devices = jax.devices()
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices: must be a positive int, got {num_devices!r}")
    if num_devices > len(devices):
        raise ValueError(f"num_devices: {num_devices} requested, JAX has {len(devices)} {jax.default_backend()} "
                         f"device(s); on the CPU start Python with XLA_FLAGS=--xla_force_host_platform_device_count="
                         f"{num_devices} (`jaxckpt demo --devices N` does)")
    return Mesh(np.array(devices[:num_devices]), (axis,))


def _axis_size(mesh: Mesh, axis: str) -> int:
    if axis not in mesh.axis_names:
        raise ValueError(f"axis: {axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    return int(mesh.shape[axis])


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """An array's sharded layout: shard s holds the global positions `indices[s]` along axis `dim`, in that order."""

    dim: int
    indices: np.ndarray  # i64[n, local]

    def spec(self, axis: str) -> P:
        return P(*([None] * self.dim), axis)

    @property
    def is_contiguous(self) -> bool:
        flat = self.indices.reshape(-1)
        return bool(np.array_equal(flat, np.arange(flat.size)))

    def sharded_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:self.dim], self.indices.size, *shape[self.dim + 1:])

    def to_sharded(self, array):
        """Global layout -> sharded layout (on the array's device; contiguous splits are the array itself)."""
        if self.is_contiguous:
            return array
        return jnp.take(jnp.asarray(array), jnp.asarray(self.indices.reshape(-1)), axis=self.dim)

    def to_global(self, array) -> np.ndarray:
        """Sharded layout -> global layout, on the host; a repeated part (the same values in every shard holding it)
        lands once. Every global position is held by some shard, so the global size is the largest index + 1."""
        array = np.asarray(array)
        size = int(self.indices.max()) + 1
        out = np.empty(array.shape[:self.dim] + (size,) + array.shape[self.dim + 1:], array.dtype)
        index = [slice(None)] * array.ndim
        index[self.dim] = self.indices.reshape(-1)
        out[tuple(index)] = array
        return out


def _blocks(start: int, size: int, n: int) -> np.ndarray:
    """[n, size / n]: shard s's contiguous block of the positions start .. start + size."""
    return start + np.arange(size).reshape(n, size // n)


def _groups(start: int, num_groups: int, width: int, n: int) -> np.ndarray:
    """[n, ...]: the groups (`width` positions each) whose heads shard s runs; with fewer groups than shards, the one
    group s * G // n that all of its heads read (repeated in every shard of that group)."""
    if num_groups % n == 0:
        return _blocks(start, num_groups * width, n)
    group = np.arange(n) * num_groups // n
    return start + group[:, None] * width + np.arange(width)


def _cat(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts, axis=1)


def _check(name: str, count: int, n: int):
    if count % n:
        raise ValueError(f"{name}: {count} must be divisible by the {n} devices of the mesh axis, so that every "
                         "shard holds whole heads")


def _check_groups(name: str, num_groups: int, n: int):
    if num_groups % n and n % num_groups:
        raise ValueError(f"{name}: {num_groups} groups must divide or be divisible by the {n} devices of the mesh "
                         "axis, so that every shard's heads read whole groups")


def check_config(config: HybridConfig, num_shards: int):
    """ValueError naming the config field whose head count `num_shards` devices cannot split into whole heads."""
    n = num_shards
    types = set(config.layer_types)
    fields = ["d_ff"]
    if "attention" in types:
        fields += ["num_heads", "num_kv_heads"]
    if "gdn" in types:
        fields += ["gdn_num_k_heads"]
    if "mamba2" in types:
        fields += ["mamba_num_heads"]
        _check_groups("mamba_n_groups", config.mamba_n_groups, n)
    if "kda" in types:
        fields += ["kda_num_heads"]
    for name in fields:
        _check(name, getattr(config, name), n)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerLayout:
    """How one mixer is split: `params` {name inside the layer: Split} (names absent are replicated) and the Splits
    of its two pools ((conv pool, recurrent pool), or (k pages, v pages) for attention)."""

    params: dict[str, Split]
    pools: tuple[Split, Split]


def layer_layout(layer, num_shards: int) -> LayerLayout:
    """The sharded layout of a Mamba2Mixer, GatedDeltaNet, KimiDeltaAttention or Attention over `num_shards`."""
    n = num_shards
    if isinstance(layer, GatedDeltaNet):
        H, HV, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
        _check("num_k_heads", H, n)
        conv = _cat(_blocks(0, H * K, n), _blocks(H * K, H * K, n), _blocks(2 * H * K, HV * V, n))
        heads = Split(0, _blocks(0, HV, n))
        params = {"in_proj_qkvz.weight": Split(0, _blocks(0, 2 * H * K + 2 * HV * V, n)),
                  "in_proj_ba.weight": Split(0, _blocks(0, 2 * HV, n)), "conv1d.weight": Split(0, conv),
                  "dt_bias": heads, "A_log": heads, "out_proj.weight": Split(1, _blocks(0, HV * V, n))}
        return LayerLayout(params, (Split(1, conv), Split(1, _blocks(0, HV, n))))
    if isinstance(layer, Mamba2Mixer):
        H, G, N, d_ssm = layer.num_heads, layer.n_groups, layer.d_state, layer.d_ssm
        _check("num_heads", H, n)
        _check_groups("n_groups", G, n)
        conv = _cat(_blocks(0, d_ssm, n), _groups(d_ssm, G, N, n), _groups(d_ssm + G * N, G, N, n))
        in_proj = _cat(_blocks(0, d_ssm, n), d_ssm + conv, _blocks(d_ssm + layer.conv_dim, H, n))
        heads = Split(0, _blocks(0, H, n))
        params = {"in_proj.weight": Split(0, in_proj), "conv1d.weight": Split(0, conv), "conv1d.bias": Split(0, conv),
                  "dt_bias": heads, "A_log": heads, "D": heads, "norm.weight": Split(0, _blocks(0, d_ssm, n)),
                  "out_proj.weight": Split(1, _blocks(0, d_ssm, n))}
        return LayerLayout(params, (Split(1, conv), Split(1, _blocks(0, H, n))))
    if isinstance(layer, KimiDeltaAttention):
        H, HD = layer.num_heads, layer.proj_dim
        _check("num_heads", H, n)
        channels, heads = Split(0, _blocks(0, HD, n)), Split(0, _blocks(0, H, n))
        params = {f"{name}.weight": channels for name in ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d",
                                                          "v_conv1d", "f_b_proj", "g_b_proj")}
        params |= {"dt_bias": channels, "A_log": heads, "b_proj.weight": heads,
                   "o_proj.weight": Split(1, _blocks(0, HD, n))}
        conv = _cat(_blocks(0, HD, n), _blocks(HD, HD, n), _blocks(2 * HD, HD, n))
        return LayerLayout(params, (Split(1, conv), Split(1, _blocks(0, H, n))))
    if isinstance(layer, Attention):
        Hq, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        _check("num_kv_heads", Hkv, n)
        kv = Split(0, _blocks(0, Hkv * D, n))
        params = {"q_proj.weight": Split(0, _blocks(0, Hq * D, n)), "k_proj.weight": kv, "v_proj.weight": kv,
                  "o_proj.weight": Split(1, _blocks(0, Hq * D, n))}
        pages = Split(2, _blocks(0, Hkv, n))
        return LayerLayout(params, (pages, pages))
    raise ValueError(f"layer: no sharded layout for {type(layer).__name__}")


def _mlp_layout(d_ff: int, n: int) -> dict[str, Split]:
    hidden = _blocks(0, d_ff, n)
    return {"gate_proj.weight": Split(0, hidden), "up_proj.weight": Split(0, hidden),
            "down_proj.weight": Split(1, hidden)}


class GroupSpanningNorm(nnx.Module):
    """Mamba2's gated RMSNorm (norm_before_gate=False) on one shard's channels when its norm group spans `span`
    shards: the group's sum of squares is the psum of the partial sums of those shards. weight [dim] (local)."""

    def __init__(self, dim: int, *, eps: float, num_groups: int, span: int, axis: str, dtype=jnp.float32):
        self.eps, self.num_groups, self.span, self.axis = eps, num_groups, span, axis
        self.weight = nnx.Param(jnp.ones(dim, dtype))

    def __call__(self, x, z):  # [T, dim] this shard's channels, gate z [T, dim]
        f32 = jnp.float32
        y = x.astype(f32) * jax.nn.silu(z.astype(f32))
        group = jax.lax.axis_index(self.axis) // self.span
        # each shard adds its partial sum to its own group's column, so one psum serves every group at once
        partial = jnp.sum(y * y, axis=-1, keepdims=True) * (jnp.arange(self.num_groups) == group)  # [T, G]
        total = jnp.take(jax.lax.psum(partial, self.axis), group, axis=-1)  # [T]
        inv = jax.lax.rsqrt(total / (self.span * y.shape[-1]) + self.eps)
        return (y * inv[..., None] * self.weight[...].astype(f32)).astype(x.dtype)


def local_mixer(layer, num_shards: int, *, axis: str, rngs: nnx.Rngs):
    """The same kind of mixer with 1 / num_shards of `layer`'s heads: what one shard runs (build it abstractly,
    inside `nnx.eval_shape`; the sharded parameters replace its own)."""
    n = num_shards
    out_proj = layer.o_proj if isinstance(layer, (KimiDeltaAttention, Attention)) else layer.out_proj
    d_model, dtype = out_proj.weight[...].shape[0], out_proj.weight[...].dtype
    common = dict(dtype=dtype, rngs=rngs)
    if isinstance(layer, GatedDeltaNet):
        return GatedDeltaNet(d_model, num_k_heads=layer.num_k_heads // n, num_v_heads=layer.num_v_heads // n,
                             head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim, conv_width=layer.conv_width,
                             norm_eps=layer.norm.eps, chunk_size=layer.chunk_size,
                             implementation=layer.implementation, **common)
    if isinstance(layer, Mamba2Mixer):
        G = layer.n_groups
        local = Mamba2Mixer(d_model, num_heads=layer.num_heads // n, head_dim=layer.head_dim, d_state=layer.d_state,
                            n_groups=G // n if G % n == 0 else 1, conv_width=layer.conv_width,
                            norm_eps=layer.norm.eps, chunk_size=layer.chunk_size,
                            implementation=layer.implementation, **common)
        if G % n:
            local.norm = GroupSpanningNorm(local.d_ssm, eps=layer.norm.eps, num_groups=G, span=n // G, axis=axis,
                                           dtype=dtype)
        return local
    if isinstance(layer, KimiDeltaAttention):
        return KimiDeltaAttention(d_model, num_heads=layer.num_heads // n, head_dim=layer.head_dim,
                                  conv_width=layer.conv_width, norm_eps=layer.o_norm.eps, chunk_size=layer.chunk_size,
                                  implementation=layer.implementation, **common)
    if isinstance(layer, Attention):
        return Attention(d_model, num_heads=layer.num_heads // n, num_kv_heads=layer.num_kv_heads // n,
                         head_dim=layer.head_dim, block_size=layer.block_size, rope_theta=layer.rope_theta,
                         query_tile=layer.query_tile, implementation=layer.implementation, **common)
    raise ValueError(f"layer: no sharded layout for {type(layer).__name__}")


def _place(module: nnx.Module, local: nnx.Module, split_of, mesh: Mesh, axis: str):
    """`module`'s parameters in the sharded layout of the abstract `local` module, placed on the mesh.

    Returns (graphdef, treedef, leaves, specs): a shard rebuilds its local module as
    nnx.merge(graphdef, treedef.unflatten(its leaves)). `split_of(name)` is the Split of a parameter or None.
    """
    graphdef, abstract = nnx.split(local)
    keyed, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    arrays = {".".join(map(str, path)): variable[...] for path, variable in nnx.to_flat_state(nnx.state(module))}
    leaves, specs = [], []
    for path, leaf in keyed:
        name = ".".join(str(key.key) for key in path if isinstance(key, jax.tree_util.DictKey))
        split, array = split_of(name), arrays[name]
        part = list(np.shape(array))
        if split is not None:
            array, part[split.dim] = split.to_sharded(array), split.indices.shape[1]
        spec = P() if split is None else split.spec(axis)
        # a layout that disagrees with the local module would only surface as a shape error deep inside the map
        if tuple(part) != tuple(leaf.shape):
            raise ValueError(f"{name}: one shard's part {tuple(part)} does not match the local module's {leaf.shape}")
        leaves.append(jax.device_put(array, NamedSharding(mesh, spec)))
        specs.append(spec)
    return graphdef, treedef, tuple(leaves), tuple(specs)


def _filled(shape, fill: float, dtype, sharding: NamedSharding):
    return jax.jit(lambda: jnp.full(shape, fill, dtype), out_shardings=sharding)()


class _Pools:
    """Moves pools between the global layout and the sharded layout of their Splits."""

    def __init__(self, mesh: Mesh, axis: str):
        self.mesh, self.axis = mesh, axis

    def spec(self, split) -> P:  # a None split: the pool is replicated
        return P() if split is None else split.spec(self.axis)

    def shard(self, pools, splits):
        return tuple(jax.device_put(pool if split is None else split.to_sharded(pool),
                                    NamedSharding(self.mesh, self.spec(split)))
                     for pool, split in zip(pools, splits))

    @staticmethod
    def unshard(pools, splits):
        return tuple(np.asarray(pool) if split is None else split.to_global(pool) for pool, split in zip(pools, splits))

    def filled(self, global_pools, splits, fill: float):
        return tuple(_filled(pool.shape if split is None else split.sharded_shape(pool.shape), fill, pool.dtype,
                             NamedSharding(self.mesh, self.spec(split)))
                     for pool, split in zip(global_pools, splits))


class ShardedLayer:
    """One mixer split by head over mesh axis `axis`: `out, pools = sharded(x, meta, pools)` as the layer's own call.

    x [T, d_model] and `meta` are replicated, `out` [T, d_model] comes back replicated (the psum of the shards'
    partial out-projections); `pools` are in the sharded layout (`shard_pools` / `unshard_pools`, `init_pools`) and
    donated.
    """

    def __init__(self, layer, mesh: Mesh, *, axis: str = AXIS):
        n = _axis_size(mesh, axis)
        self.layer, self.mesh, self.axis = layer, mesh, axis
        self.layout = layer_layout(layer, n)
        local = nnx.eval_shape(lambda: local_mixer(layer, n, axis=axis, rngs=nnx.Rngs(0)))
        graphdef, treedef, self.params, specs = _place(layer, local, self.layout.params.get, mesh, axis)
        self._pools = _Pools(mesh, axis)
        pool_specs = tuple(split.spec(axis) for split in self.layout.pools)

        def body(params, x, meta, pools):
            out, pools = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))(x, meta, pools)
            return jax.lax.psum(out, axis), pools

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P(), pool_specs),
                               out_specs=(P(), pool_specs), check_vma=False)
        self._call = jax.jit(mapped, donate_argnums=3)

    def init_pools(self, num_slots: int, *, fill: float = 0.0):
        """Pools of `num_slots` slots (pages for attention) in the sharded layout: fp32 states, KV in the weights'
        dtype."""
        if num_slots < 2:
            raise ValueError(f"num_slots: a pool needs at least 2 entries (entry 0 is null), got {num_slots}")
        layer = self.layer
        if isinstance(layer, Attention):
            shapes = [(num_slots, *layer.page_shape)] * 2
            dtypes = [layer.o_proj.weight[...].dtype] * 2
        else:
            shapes, dtypes = [(num_slots, *shape) for shape in layer.state_shapes], [jnp.float32] * 2
        return self._pools.filled([jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes)], self.layout.pools,
                                  fill)

    def shard_pools(self, pools):
        """Single-device pools -> the sharded layout on the mesh."""
        return self._pools.shard(pools, self.layout.pools)

    def unshard_pools(self, pools) -> tuple[np.ndarray, ...]:
        """The pools in the single-device layout, as host arrays."""
        return self._pools.unshard(pools, self.layout.pools)

    def __call__(self, x, meta: StepMetadata, pools):
        return self._call(self.params, x, meta, pools)


class _ShardedCaches:
    """The cache moves of a sharded model; subclasses set `model`, `layouts` (a LayerLayout per layer) and
    `_pools`."""

    def init_caches(self, num_kv_pages: int, num_state_slots: int, *, fill: float = 0.0) -> Caches:
        """The model's `init_caches` in the sharded layout, placed on the mesh (nothing built on one device)."""
        shapes = jax.eval_shape(lambda: self.model.init_caches(num_kv_pages, num_state_slots))
        return Caches(tuple(self._pools.filled(pools, layout.pools, fill)
                            for pools, layout in zip(shapes.layers, self.layouts)), shapes.layer_types)

    def shard_caches(self, caches: Caches) -> Caches:
        """Single-device caches -> the sharded layout on the mesh."""
        return Caches(tuple(self._pools.shard(pools, layout.pools)
                            for pools, layout in zip(caches.layers, self.layouts)), caches.layer_types)

    def unshard_caches(self, caches: Caches) -> Caches:
        """Sharded caches -> the single-device layout, as host arrays (to compare, or to hand states elsewhere)."""
        return Caches(tuple(self._pools.unshard(pools, layout.pools)
                            for pools, layout in zip(caches.layers, self.layouts)), caches.layer_types)


class ShardedHybrid(_ShardedCaches):
    """A HybridModel split by head over mesh axis `axis`: parameters placed once, caches in the sharded layout.

    `forward(tokens, meta, caches)` is `jaxckpt.models.forward` on the mesh (jitted, caches donated, the same host
    checks); logits come back replicated. `init_caches`, `shard_caches`, `unshard_caches` move between layouts.
    """

    def __init__(self, model: HybridModel, mesh: Mesh, *, axis: str = AXIS):
        n = _axis_size(mesh, axis)
        config = model.config
        check_config(config, n)
        self.model, self.mesh, self.axis, self.num_shards = model, mesh, axis, n
        self.layouts = tuple(layer_layout(block.mixer, n) for block in model.layers)
        mlp = _mlp_layout(config.d_ff, n)

        def build():
            rngs = nnx.Rngs(0)
            local = HybridModel(config, rngs=rngs)
            for block, whole in zip(local.layers, model.layers):
                block.mixer = local_mixer(whole.mixer, n, axis=axis, rngs=rngs)
                block.mlp = SwiGLU(config.d_model, config.d_ff // n, dtype=jnp.dtype(config.dtype), rngs=rngs)
            return local

        def split_of(name: str):  # "layers.{i}.mixer.{param}" or "layers.{i}.mlp.{param}"; the rest is replicated
            parts = name.split(".", 3)
            if parts[0] != "layers" or parts[2] not in ("mixer", "mlp"):
                return None
            return (self.layouts[int(parts[1])].params if parts[2] == "mixer" else mlp).get(parts[3])

        graphdef, treedef, self.params, specs = _place(model, nnx.eval_shape(build), split_of, mesh, axis)
        self._pools = _Pools(mesh, axis)
        cache_specs = tuple(tuple(split.spec(axis) for split in layout.pools) for layout in self.layouts)
        layer_types = config.layer_types
        psum = functools.partial(jax.lax.psum, axis_name=axis)

        def body(params, tokens, meta, layers):
            local = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
            logits, caches = local(tokens, meta, Caches(layers, layer_types), reduce=psum)
            return logits, caches.layers

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P(), cache_specs),
                               out_specs=(P(), cache_specs), check_vma=False)
        self._forward = jax.jit(mapped, donate_argnums=3)

    def forward(self, tokens, meta: StepMetadata, caches: Caches):
        """(logits fp32 [N, vocab], caches) of one step, as `jaxckpt.models.forward`; caches donated."""
        validate_step(tokens, meta, num_state_slots=caches.num_state_slots, num_kv_pages=caches.num_kv_pages)
        logits, layers = self._forward(self.params, tokens, meta, caches.layers)
        return logits, Caches(layers, caches.layer_types)


def _published_mixer_layout(layer, n: int) -> LayerLayout | None:
    """Layouts of the published models' own attentions (None for the shared layers)."""
    from jaxckpt.models.kimi_linear import KimiLinearAttention
    from jaxckpt.models.qwen3_next import Qwen3NextAttention

    if isinstance(layer, Qwen3NextAttention):
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        if layer.o_proj.bias is not None:
            raise ValueError("attention_bias: the sharded Qwen3-Next attention has no biased projections")
        _check("num_key_value_heads", Hkv, n)
        kv = Split(0, _blocks(0, Hkv * D, n))
        params = {"q_proj.weight": Split(0, _blocks(0, 2 * H * D, n)), "k_proj.weight": kv, "v_proj.weight": kv,
                  "o_proj.weight": Split(1, _blocks(0, H * D, n))}  # q_proj rows: [query | gate] per head
        pages = Split(2, _blocks(0, Hkv, n))
        return LayerLayout(params, (pages, pages))
    if isinstance(layer, KimiLinearAttention):
        H = layer.num_heads
        _check("num_attention_heads", H, n)
        q = Split(0, _blocks(0, H * (layer.nope_dim + layer.rope_dim), n))
        # the latent projections and the latent pages serve every head: replicated, each shard writes the same
        params = {"q_proj.weight": q, "q_b_proj.weight": q,
                  "kv_b_proj.weight": Split(0, _blocks(0, H * (layer.nope_dim + layer.v_head_dim), n)),
                  "o_proj.weight": Split(1, _blocks(0, H * layer.v_head_dim, n))}
        return LayerLayout(params, (None, None))
    return None


def _local_published_mixer(layer, config, n: int, *, axis: str, rngs: nnx.Rngs):
    """The shard-local module of a published model's mixer: its class over 1 / n of the heads."""
    from jaxckpt.models.granitemoehybrid import GraniteMoeHybridAttention
    from jaxckpt.models.kimi_linear import KimiLinearAttention
    from jaxckpt.models.qwen3_next import Qwen3NextAttention

    dtype = jnp.dtype(config.dtype)
    if isinstance(layer, Qwen3NextAttention):
        local = dataclasses.replace(config, num_attention_heads=layer.num_heads // n,
                                    num_key_value_heads=layer.num_kv_heads // n)
        return Qwen3NextAttention(local, dtype=dtype, rngs=rngs)
    if isinstance(layer, KimiLinearAttention):
        local = dataclasses.replace(config, num_attention_heads=layer.num_heads // n, num_key_value_heads=None)
        return KimiLinearAttention(local, dtype=dtype, rngs=rngs)
    if isinstance(layer, GraniteMoeHybridAttention):
        _check("num_key_value_heads", layer.num_kv_heads, n)
        return GraniteMoeHybridAttention(
            config.hidden_size, scale=layer.scale, use_rope=layer.use_rope, num_heads=layer.num_heads // n,
            num_kv_heads=layer.num_kv_heads // n, head_dim=layer.head_dim, block_size=layer.block_size,
            rope_theta=layer.rope_theta, query_tile=layer.query_tile, implementation=layer.implementation, dtype=dtype,
            rngs=rngs)
    return local_mixer(layer, n, axis=axis, rngs=rngs)


class LocalExperts(Experts):
    """One shard's E / n experts of an expert-sharded `Experts`: shard s holds experts s E / n .. (s + 1) E / n and
    adds the routed pairs of those only (the router is replicated, so every shard sees every token's choice)."""

    def __init__(self, num_experts: int, d_model: int, d_ff: int, *, axis: str, dtype, rngs: nnx.Rngs):
        super().__init__(num_experts, d_model, d_ff, dtype=dtype, rngs=rngs)
        self.axis = axis

    def __call__(self, x, weights, indices):
        return super().__call__(x, weights, indices - jax.lax.axis_index(self.axis) * self.num_experts)


def _feed_forward_parts(module, prefix: str = ""):
    """(dotted path, module) of every SwiGLU, Granite shared MLP and Experts inside a layer's feed-forward module."""
    from jaxckpt.models.granitemoehybrid import GraniteMoeHybridMLP

    if isinstance(module, (SwiGLU, GraniteMoeHybridMLP, Experts)):
        yield prefix, module
        return
    for name, child in vars(module).items():
        if isinstance(child, nnx.Module):
            yield from _feed_forward_parts(child, f"{prefix}{name}.")


def _feed_forward_layout(module, n: int) -> tuple[dict[str, Split], object]:
    """({param name: Split}, local module) of one feed-forward part: SwiGLU widths split like the hybrid's MLP,
    the Granite shared MLP's [gate | up] rows split part by part, experts split whole (expert parallel)."""
    from jaxckpt.models.granitemoehybrid import GraniteMoeHybridMLP

    if isinstance(module, Experts):
        E = module.num_experts
        _check("num_experts", E, n)
        experts = Split(0, _blocks(0, E, n))
        return {"gate_up_proj": experts, "down_proj": experts}, E // n
    if isinstance(module, GraniteMoeHybridMLP):
        width = module.output_linear.weight.shape[1]
        _check("shared_intermediate_size", width, n)
        return ({"input_linear.weight": Split(0, _cat(_blocks(0, width, n), _blocks(width, width, n))),
                 "output_linear.weight": Split(1, _blocks(0, width, n))}, width // n)
    width = module.down_proj.weight.shape[1]
    _check("intermediate_size", width, n)
    return _mlp_layout(width, n), width // n


class ShardedCausalLM(_ShardedCaches):
    """A published-architecture model (`common.CausalLM`: Qwen3-Next, Kimi-Linear, GraniteMoeHybrid) split over mesh
    axis `axis`: mixers by head as `ShardedHybrid` does (MLA's latent and its pages replicated), dense and shared
    MLPs by hidden width, routed experts whole per shard (expert parallel; the router replicated), embeddings, norms
    and the head replicated. `forward`, `init_caches`, `shard_caches`, `unshard_caches` as `ShardedHybrid`'s."""

    def __init__(self, model, mesh: Mesh, *, axis: str = AXIS):
        n = _axis_size(mesh, axis)
        config = model.config
        self.model, self.mesh, self.axis, self.num_shards = model, mesh, axis, n
        self.layouts, splits = [], {}
        mixer_names = []
        for i, layer in enumerate(model.model.layers):
            mixer = layer.mixer
            mixer_names.append(next(k for k, v in vars(layer).items() if v is mixer))
            layout = _published_mixer_layout(mixer, n) or layer_layout(mixer, n)
            self.layouts.append(layout)
            splits |= {f"model.layers.{i}.{mixer_names[i]}.{k}": v for k, v in layout.params.items()}
            for path, part in _feed_forward_parts(layer):
                params, _ = _feed_forward_layout(part, n)
                splits |= {f"model.layers.{i}.{path}{k}": v for k, v in params.items()}

        def build():
            rngs = nnx.Rngs(0)
            local = type(model)(config, rngs=rngs)
            dtype = jnp.dtype(config.dtype)
            for layer, whole_layer, name in zip(local.model.layers, model.model.layers, mixer_names):
                setattr(layer, name, _local_published_mixer(whole_layer.mixer, config, n, axis=axis, rngs=rngs))
                for path, part in list(_feed_forward_parts(whole_layer)):
                    _, size = _feed_forward_layout(part, n)
                    if isinstance(part, Experts):
                        replacement = LocalExperts(size, part.gate_up_proj.shape[1], part.d_ff, axis=axis,
                                                   dtype=dtype, rngs=rngs)
                    else:
                        d_model = (part.down_proj if isinstance(part, SwiGLU) else part.output_linear).weight.shape[0]
                        replacement = type(part)(d_model, size, dtype=dtype, rngs=rngs)
                    *parents, leaf = path.rstrip(".").split(".")
                    owner = layer
                    for parent in parents:
                        owner = getattr(owner, parent)
                    setattr(owner, leaf, replacement)
            return local

        graphdef, treedef, self.params, specs = _place(model, nnx.eval_shape(build), splits.get, mesh, axis)
        self._pools = _Pools(mesh, axis)
        cache_specs = tuple(tuple(map(self._pools.spec, layout.pools)) for layout in self.layouts)
        layer_types = config.kinds
        psum = functools.partial(jax.lax.psum, axis_name=axis)

        def body(params, tokens, meta, layers, all_tokens):
            local = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
            logits, caches = local(tokens, meta, Caches(layers, layer_types), all_tokens=all_tokens, reduce=psum)
            return logits, caches.layers

        self._forward = {
            all_tokens: jax.jit(jax.shard_map(functools.partial(body, all_tokens=all_tokens), mesh=mesh,
                                              in_specs=(specs, P(), P(), cache_specs),
                                              out_specs=(P(), cache_specs), check_vma=False), donate_argnums=3)
            for all_tokens in (False, True)}

    def forward(self, tokens, meta: StepMetadata, caches: Caches, *, all_tokens: bool = False):
        """(logits fp32, caches) of one step, as `jaxckpt.models.common.forward`; caches donated."""
        validate_step(tokens, meta, num_state_slots=caches.num_state_slots, num_kv_pages=caches.num_kv_pages)
        logits, layers = self._forward[all_tokens](self.params, tokens, meta, caches.layers)
        return logits, Caches(layers, caches.layer_types)


__all__ = ["AXIS", "GroupSpanningNorm", "LayerLayout", "LocalExperts", "ShardedCausalLM", "ShardedHybrid",
           "ShardedLayer", "Split", "check_config", "head_mesh", "layer_layout", "local_mixer"]
