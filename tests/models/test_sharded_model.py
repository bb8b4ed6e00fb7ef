"""The head-sharded hybrid model, engine and layers on 1, 2 and 4 fake CPU devices match the single-device ones.

Which meshes: 4 devices split every head count and hold fewer Mamba2 groups (2) than shards, so the groups are
repeated per shard and the gated norm's group spans shards (`GroupSpanningNorm`); 2 devices split the groups evenly;
1 device runs the unchanged single-device program inside the map, bit for bit. Any other mesh size takes one of these
paths. The whole model runs every step on 4 devices; the 2-device path is Mamba2's alone (the other layouts do not
depend on the group count) and the 1-device one is the map's, so those run one layer each (`ShardedLayer`).

One subprocess (`multi_device.run_script`) runs every check; caches are poisoned with NaN, so a slot or page written by
one side and not the other shows up as a NaN mismatch.
"""

from tests.models.multi_device import run_script

SCRIPT = r"""
from jaxckpt.cli import request_host_devices

request_host_devices(["--devices", "4"])

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxckpt.engine import Engine, EngineConfig, HybridRunner
from jaxckpt.layers import StepMetadata, pack_tokens
from jaxckpt.models import Caches, HybridConfig, HybridModel, forward
from jaxckpt.models.sharded import ShardedHybrid, ShardedLayer, head_mesh

assert jax.device_count() == 4, jax.devices()
config = HybridConfig.tiny_sharded()
model = HybridModel(config, rngs=nnx.Rngs(7))
graphdef, state = nnx.split(model)
# the engine's bucket (HybridRunner below): its sharded prefill program is this test's, compiled once
PAGES, SLOTS = 32, 16
BUCKET = dict(num_kv_pages=PAGES, num_state_slots=SLOTS, num_tokens=64, num_rows=4, num_checkpoints=4,
              max_blocks=config.max_model_len // config.block_size, block_size=config.block_size,
              max_model_len=config.max_model_len)
rng = np.random.default_rng(12)
first = rng.integers(0, 256, 38)
second = np.concatenate([first[:16], rng.integers(0, 256, 22)])
# prefill with two checkpoints; resume `second` from checkpoint slot 2 and the first two pages of `first`; a decode
# row of `second` with a fresh prefill row in one step
STEPS = [
    ([first], dict(context_lens=[0], block_tables=[[1, 2, 3, 4, 5]], initial_state_indices=[0],
                   final_state_indices=[1], checkpoint_cu=[0, 2], checkpoint_offsets=[16, 30],
                   checkpoint_state_indices=[2, 5])),
    ([second[16:37]], dict(context_lens=[16], block_tables=[[1, 2, 6, 7, 8]], initial_state_indices=[2],
                           final_state_indices=[3])),
    ([second[37:], first[:12]], dict(context_lens=[37, 0], block_tables=[[1, 2, 6, 7, 8], [9, 10]],
                                     initial_state_indices=[3, 0], final_state_indices=[3, 4], num_decodes=1)),
]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    same_nan = np.array_equal(np.isnan(a), np.isnan(b))
    real = ~np.isnan(b)
    if not real.any():
        return 0.0 if same_nan else np.inf
    err = np.max(np.abs(a[real] - b[real])) / max(np.max(np.abs(b[real])), 1e-30)
    return float(err) if same_nan else np.inf


def check(name, n, got, want, worst):
    err = rel(got, want)
    # one device runs the unchanged single-device program inside the map
    assert (err == 0.0) if n == 1 else (err <= 1e-5), (name, n, err)
    return max(worst, err)


def run_steps(call, caches, steps, to_host):
    # host copies right away: the next step donates the caches
    results = []
    for rows, args in steps:
        meta = StepMetadata.build([len(r) for r in rows], **args, **BUCKET)
        logits, caches = call(pack_tokens(rows, meta.num_tokens), meta, caches)
        results.append((np.asarray(logits)[:len(rows)], [[np.asarray(p) for p in pools]
                                                        for pools in to_host(caches).layers]))
    return results, caches


single, _ = run_steps(lambda *a: forward(graphdef, state, *a), model.init_caches(PAGES, SLOTS, fill=np.nan), STEPS,
                      lambda caches: caches)
single_caches = tuple(tuple(pools) for pools in single[-1][1])
# the whole model on 4 devices: prefill with checkpoints, resume, decode beside a fresh prefill row
sharded = ShardedHybrid(model, head_mesh(4))
got, caches = run_steps(sharded.forward, sharded.init_caches(PAGES, SLOTS, fill=np.nan), STEPS, sharded.unshard_caches)
worst = 0.0
for step, ((logits, layers), (want_logits, want_layers)) in enumerate(zip(got, single)):
    worst = check(f"logits {step}", 4, logits, want_logits, worst)
    for layer, (pools, want) in enumerate(zip(layers, want_layers)):
        for part, (a, b) in enumerate(zip(pools, want)):
            assert a.shape == b.shape, (layer, part, a.shape, b.shape)
            worst = check(f"step {step} layer {layer} pool {part}", 4, a, b, worst)
state_pool = caches.layers[0][1]
assert tuple(state_pool.sharding.spec)[:2] == (None, "heads"), state_pool.sharding
# single-device caches into the sharded layout and back (Mamba2's repeated B / C channels included)
back = sharded.unshard_caches(sharded.shard_caches(Caches(single_caches, config.layer_types)))
assert all(np.array_equal(a, b, equal_nan=True) for pools, want in zip(back.layers, single_caches)
           for a, b in zip(pools, want))
print(f"model: mesh 4 ok worst_rel={worst:.1e}")

# the engine over the sharded runner: `second` resumes from a checkpoint slot the first prompt's shards wrote
runner = HybridRunner(model, mesh=head_mesh(4), prefill_tokens=64, num_rows=4, num_checkpoints=4, fill=float("nan"))
engine = Engine(runner, EngineConfig(mode="several", num_kv_pages=PAGES, num_state_slots=SLOTS, max_new_tokens=1,
                                     max_num_scheduled_tokens=64))
results = engine.run([first.tolist(), second.tolist()])
assert [r.hit_tokens for r in results] == [0, 16], [r.hit_tokens for r in results]
for prompt, result in zip((first, second), results):
    assert rel(result.first_logits, runner.reference_logits(prompt)[-1]) <= 1e-4
print("engine: mesh 4 ok")

# one mixer at a time (`ShardedLayer`) against the layer's single-device call, from random pools read at slot 2 and
# pages 1, 2: Mamba2 with its 2 groups split evenly over 2 devices, and attention on 1 device, bit for bit
meta = StepMetadata.build([21], context_lens=[16], block_tables=[[1, 2, 6, 7, 8]], initial_state_indices=[2],
                          final_state_indices=[3], checkpoint_cu=[0, 2], checkpoint_offsets=[5, 20],
                          checkpoint_state_indices=[4, 6], **BUCKET)
x = jax.random.normal(jax.random.key(3), (meta.num_tokens, config.d_model), jnp.float32)
worst = 0.0
for layer_type, n in (("mamba2", 2), ("attention", 1)):
    layer = model.layers[config.layer_types.index(layer_type)].mixer
    shapes = ([(PAGES, *layer.page_shape)] * 2 if layer_type == "attention"
              else [(SLOTS, *shape) for shape in layer.state_shapes])
    start = tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in shapes)
    layer_graphdef, layer_state = nnx.split(layer)
    want_out, want_pools = jax.jit(lambda s, *a: nnx.merge(layer_graphdef, s)(*a))(layer_state, x, meta, start)
    sharded = ShardedLayer(layer, head_mesh(n))
    out, pools = sharded(x, meta, sharded.shard_pools(start))
    worst = check(f"{layer_type} out", n, out, want_out, worst)
    for a, b in zip(sharded.unshard_pools(pools), want_pools):
        worst = check(f"{layer_type} pool", n, a, b, worst)
print(f"layers: mamba2 mesh 2, attention mesh 1 ok worst_rel={worst:.1e}")

errors = []
for call in (lambda: ShardedHybrid(nnx.eval_shape(lambda: HybridModel(HybridConfig.tiny(), rngs=nnx.Rngs(0))),
                                   head_mesh(4)),
             lambda: ShardedHybrid(model, head_mesh(2), axis="model"),
             lambda: head_mesh(5)):
    try:
        call()
    except ValueError as error:
        errors.append(str(error).split(":")[0])
assert errors == ["num_kv_heads", "axis", "num_devices"], errors
print("indivisible: ValueError", " ".join(errors))
"""


def test_sharded_model_matches_single_device():
    lines = run_script(SCRIPT)
    assert any(line.startswith("model: mesh 4 ok") for line in lines), lines
    assert "engine: mesh 4 ok" in lines, lines
    assert any(line.startswith("layers: mamba2 mesh 2, attention mesh 1 ok") for line in lines), lines
    assert "indivisible: ValueError num_kv_heads axis num_devices" in lines, lines


def test_a_shard_keeps_the_attention_implementation_asked_for():
    from flax import nnx

    from jaxckpt.layers import Attention
    from jaxckpt.models.sharded import local_mixer

    for implementation in ("xla", "pallas_triton", None):
        layer = Attention(64, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, implementation=implementation,
                          rngs=nnx.Rngs(0))
        local = local_mixer(layer, 2, axis="heads", rngs=nnx.Rngs(0))
        assert (local.num_heads, local.implementation) == (2, implementation)
