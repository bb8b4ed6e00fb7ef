"""The published-architecture models (Qwen3-Next, Kimi-Linear, GraniteMoeHybrid) split over 4 fake CPU devices
(`jaxckpt.models.sharded.ShardedCausalLM`: heads, MLP widths, experts) match the single-device model: a prefill
of two rows with checkpoints, a resume from a checkpoint, and (Kimi-Linear, whose MLA decodes its own way) a decode
step beside a fresh prefill row; logits and every pool (NaN-poisoned, so a slot or page written on one side only
shows).

Each model has two layers, its recurrent mixer and its attention, between them every MLP kind it has (dense, MoE,
shared), so every layout of `ShardedCausalLM` runs. 4 devices split every head and expert count and hold fewer of
Granite's Mamba2 groups (2) than shards; the even split of groups and the 1-device map are
tests/models/test_sharded_model.py's. Models are built from our own configs with random weights: their parity with
transformers is the other test files' business. One subprocess (`multi_device.run_script`) runs every check."""

from tests.models.multi_device import run_script

SCRIPT = r"""
from jaxckpt.cli import request_host_devices

request_host_devices(["--devices", "4"])

import jax
import numpy as np
from flax import nnx

from jaxckpt.layers import StepMetadata, pack_tokens
from jaxckpt.models import (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, KimiLinearConfig,
                            KimiLinearForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM)
from jaxckpt.models.common import forward
from jaxckpt.models.sharded import ShardedCausalLM, head_mesh

assert jax.device_count() == 4, jax.devices()
SERVING = dict(block_size=8, max_model_len=128, chunk_size=16, implementation="xla")
MODELS = {
    "qwen3_next": (Qwen3NextForCausalLM, Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=8, num_key_value_heads=4,
        head_dim=8, layer_types=("linear_attention", "full_attention"), linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=(1,),
        partial_rotary_factor=0.5, **SERVING)),
    "kimi_linear": (KimiLinearForCausalLM, KimiLinearConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        layer_types=("linear_attention", "full_attention"), mlp_layer_types=("dense", "sparse"), kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=12, linear_num_heads=4, linear_head_dim=8, moe_intermediate_size=16, num_local_experts=8,
        num_experts_per_tok=3, n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, **SERVING)),
    "granitemoehybrid": (GraniteMoeHybridForCausalLM, GraniteMoeHybridConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
        layer_types=("linear_attention", "full_attention"), mamba_n_heads=8, mamba_d_head=8,
        mamba_d_state=8, mamba_n_groups=2, intermediate_size=16, shared_intermediate_size=24, num_local_experts=8,
        num_experts_per_tok=2, position_embedding_type="rope", embedding_multiplier=2.0, residual_multiplier=0.7,
        attention_multiplier=0.3, logits_scaling=3.0, **SERVING)),
}
PAGES, SLOTS = 24, 8
BUCKET = dict(num_kv_pages=PAGES, num_state_slots=SLOTS, num_tokens=64, num_rows=4, num_checkpoints=4, max_blocks=6,
              block_size=8, max_model_len=128)
rng = np.random.default_rng(3)
first, other = rng.integers(0, 64, 30), rng.integers(0, 64, 13)
STEPS = [
    ([first, other], dict(context_lens=[0, 0], block_tables=[[1, 2, 3, 4], [5, 6]], initial_state_indices=[0, 0],
                          final_state_indices=[1, 2], checkpoint_cu=[0, 2, 3], checkpoint_offsets=[16, 24, 5],
                          checkpoint_state_indices=[3, 4, 5])),
    ([first[16:27]], dict(context_lens=[16], block_tables=[[1, 2, 7, 8]], initial_state_indices=[3],
                          final_state_indices=[6])),
    ([first[27:28], other[:9]], dict(context_lens=[27, 0], block_tables=[[1, 2, 7, 8], [9, 10]],
                                     initial_state_indices=[6, 0], final_state_indices=[6, 7], num_decodes=1)),
]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return np.inf
    real = ~np.isnan(b)
    return float(np.max(np.abs(a[real] - b[real])) / max(np.max(np.abs(b[real])), 1e-30)) if real.any() else 0.0


def run(call, caches, to_host, steps):
    out = []
    for rows, args in steps:
        meta = StepMetadata.build([len(r) for r in rows], **args, **BUCKET)
        logits, caches = call(pack_tokens(rows, meta.num_tokens), meta, caches)
        out.append((np.asarray(logits), [[np.asarray(p) for p in pools] for pools in to_host(caches).layers]))
    return out


for name, (cls, config) in MODELS.items():
    # the decode step compiles a program of its own; MLA decodes its own way, while Qwen3-Next's and Granite's
    # attentions decode through `paged_attention` as the hybrid's `Attention` does, and their recurrent mixers are
    # the hybrid's (tests/models/test_sharded_model.py decodes all of those on 4 devices)
    steps = STEPS if name == "kimi_linear" else STEPS[:2]
    model = cls(config, rngs=nnx.Rngs(5))
    graphdef, state = nnx.split(model)
    want = run(lambda *a: forward(graphdef, state, *a, all_tokens=True), model.init_caches(PAGES, SLOTS, fill=np.nan),
               lambda caches: caches, steps)
    sharded = ShardedCausalLM(model, head_mesh(4))
    # really split: the recurrent state pool by head, the stacked experts (the only 3-D parameters) by expert
    caches = sharded.init_caches(PAGES, SLOTS, fill=np.nan)
    assert tuple(caches.layers[0][1].sharding.spec)[:2] == (None, "heads")
    assert any(p.ndim == 3 and tuple(p.sharding.spec) == ("heads",) for p in sharded.params)
    got = run(lambda *a: sharded.forward(*a, all_tokens=True), caches, sharded.unshard_caches, steps)
    worst = 0.0
    for step, ((logits, layers), (want_logits, want_layers)) in enumerate(zip(got, want)):
        worst = max(worst, rel(logits, want_logits))
        for layer, (pools, want_pools) in enumerate(zip(layers, want_layers)):
            for a, b in zip(pools, want_pools):
                assert a.shape == b.shape, (name, layer, a.shape, b.shape)
                worst = max(worst, rel(a, b))
    assert worst <= 1e-5, (name, worst)
    print(f"{name}: mesh 4 ok worst_rel={worst:.1e}")

errors = []
for call in (lambda: ShardedCausalLM(nnx.eval_shape(lambda: KimiLinearForCausalLM(
                 MODELS["kimi_linear"][1].__class__(**{**MODELS["kimi_linear"][1].__dict__, "num_attention_heads": 3}),
                 rngs=nnx.Rngs(0))), head_mesh(2)),
             lambda: ShardedCausalLM(nnx.eval_shape(lambda: GraniteMoeHybridForCausalLM(
                 MODELS["granitemoehybrid"][1].__class__(**{**MODELS["granitemoehybrid"][1].__dict__,
                                                          "num_local_experts": 6}), rngs=nnx.Rngs(0))),
                                     head_mesh(4))):
    try:
        call()
    except ValueError as error:
        errors.append(str(error).split(":")[0])
assert errors == ["num_attention_heads", "num_experts"], errors
print("indivisible: ValueError", " ".join(errors))
"""


def test_sharded_published_models_match_single_device():
    lines = run_script(SCRIPT)
    for name in ("qwen3_next", "kimi_linear", "granitemoehybrid"):
        assert any(line.startswith(f"{name}: mesh 4 ok") for line in lines), lines
    assert "indivisible: ValueError num_attention_heads num_experts" in lines, lines
