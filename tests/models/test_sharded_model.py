"""The head-sharded hybrid model, engine and layers on 1, 2 and 8 fake CPU devices match the single-device ones.

The device count is fixed when jax starts, so the checks run in one subprocess; it asks for 8 host devices the way
`jaxckpt demo --devices 8` does (`jaxckpt.cli.request_host_devices`, before jax is imported) and prints one summary
line per check that the test asserts. Caches are poisoned with NaN, so a slot or page written by one side and not
the other shows up as a NaN mismatch.
"""

import os
import subprocess
import sys

SCRIPT = r"""
from jaxckpt.cli import request_host_devices

request_host_devices(["--devices", "8"])

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxckpt.engine import Engine, EngineConfig, HybridRunner
from jaxckpt.layers import StepMetadata, pack_tokens
from jaxckpt.models import Caches, HybridConfig, HybridModel, forward
from jaxckpt.models.sharded import ShardedHybrid, ShardedLayer, head_mesh

assert jax.device_count() == 8, jax.devices()
config = HybridConfig.tiny_sharded()
model = HybridModel(config, rngs=nnx.Rngs(7))
graphdef, state = nnx.split(model)
PAGES, SLOTS = 32, 8
BUCKET = dict(num_kv_pages=PAGES, num_state_slots=SLOTS, num_tokens=64, num_rows=4, num_checkpoints=4, max_blocks=8,
              block_size=config.block_size, max_model_len=config.max_model_len)
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
worst = 0.0
for n in (1, 2, 8):  # 4 devices: tests/models/test_sharded_published.py
    sharded = ShardedHybrid(model, head_mesh(n))
    # the decode step compiles a second program; once, on the widest mesh, keeps the test short
    steps = STEPS if n == 8 else STEPS[:2]
    got, caches = run_steps(sharded.forward, sharded.init_caches(PAGES, SLOTS, fill=np.nan), steps,
                            sharded.unshard_caches)
    for step, ((logits, layers), (want_logits, want_layers)) in enumerate(zip(got, single)):
        worst = check(f"logits {step}", n, logits, want_logits, worst)
        for layer, (pools, want) in enumerate(zip(layers, want_layers)):
            for part, (a, b) in enumerate(zip(pools, want)):
                assert a.shape == b.shape, (n, layer, part, a.shape, b.shape)
                worst = check(f"step {step} layer {layer} pool {part}", n, a, b, worst)
    state_pool = caches.layers[0][1]
    assert n == 1 or tuple(state_pool.sharding.spec)[:2] == (None, "heads"), state_pool.sharding
    # single-device caches into the sharded layout and back (Mamba2's repeated B / C channels included)
    back = sharded.unshard_caches(sharded.shard_caches(Caches(single_caches, config.layer_types)))
    assert all(np.array_equal(a, b, equal_nan=True) for pools, want in zip(back.layers, single_caches)
               for a, b in zip(pools, want))
print(f"model: meshes 1 2 8 ok worst_rel={worst:.1e}")

# the engine over the sharded runner: `second` resumes from a checkpoint slot the first prompt's shards wrote
runner = HybridRunner(model, mesh=head_mesh(8), prefill_tokens=64, fill=float("nan"))
engine = Engine(runner, EngineConfig(mode="several", num_kv_pages=PAGES, num_state_slots=16, max_new_tokens=2,
                                     max_num_scheduled_tokens=64))
results = engine.run([first.tolist(), second.tolist()])
assert [r.hit_tokens for r in results] == [0, 16], [r.hit_tokens for r in results]
for prompt, result in zip((first, second), results):
    assert rel(result.first_logits, runner.reference_logits(prompt)[-1]) <= 1e-4
print("engine: mesh 8 ok")

# every mixer on its own: outputs and pools against the layer's single-device call on 8 devices (Mamba2's groups
# shared, its norm group spanning shards); random pools, read at slot 2 and pages 1, 2
meta = StepMetadata.build([21], context_lens=[16], block_tables=[[1, 2, 6, 7, 8]], initial_state_indices=[2],
                          final_state_indices=[3], checkpoint_cu=[0, 2], checkpoint_offsets=[5, 20],
                          checkpoint_state_indices=[4, 6], **BUCKET)
x = jax.random.normal(jax.random.key(3), (meta.num_tokens, config.d_model), jnp.float32)
worst = 0.0
for block in model.layers:
    layer = block.mixer
    name = type(layer).__name__
    shapes = ([(PAGES, *layer.page_shape)] * 2 if hasattr(layer, "page_shape")
              else [(SLOTS, *shape) for shape in layer.state_shapes])
    start = tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in shapes)
    layer_graphdef, layer_state = nnx.split(layer)
    want_out, want_pools = jax.jit(lambda s, *a: nnx.merge(layer_graphdef, s)(*a))(layer_state, x, meta, start)
    sharded = ShardedLayer(layer, head_mesh(8))
    out, pools = sharded(x, meta, sharded.shard_pools(start))
    worst = check(f"{name} out", 8, out, want_out, worst)
    for a, b in zip(sharded.unshard_pools(pools), want_pools):
        worst = check(f"{name} pool", 8, a, b, worst)
print(f"layers: mesh 8 ok worst_rel={worst:.1e}")

errors = []
for call in (lambda: ShardedHybrid(nnx.eval_shape(lambda: HybridModel(HybridConfig.tiny(), rngs=nnx.Rngs(0))),
                                   head_mesh(8)),
             lambda: ShardedHybrid(model, head_mesh(2), axis="model"),
             lambda: head_mesh(9)):
    try:
        call()
    except ValueError as error:
        errors.append(str(error).split(":")[0])
assert errors == ["num_heads", "axis", "num_devices"], errors
print("indivisible: ValueError", " ".join(errors))
"""


def test_sharded_model_matches_single_device():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("model: meshes 1 2 8 ok") for line in lines), result.stdout
    assert "engine: mesh 8 ok" in lines, result.stdout
    assert any(line.startswith("layers: mesh 8 ok") for line in lines), result.stdout
    assert "indivisible: ValueError num_heads axis num_devices" in lines, result.stdout
