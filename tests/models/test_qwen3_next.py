"""Qwen3-Next against transformers' own `Qwen3NextForCausalLM`: a tiny random model saved by `save_pretrained` in
several shards and loaded by the files' names; fp32 logits of rows of several lengths in one packed batch; MoE
routing; a checkpointed prefill, a resume from the checkpoint and three decode steps against transformers' cached
path; cache conversion both ways; negative controls that show each comparison catches a wrong weight.

All our steps run through one jitted forward per shape (prefill 64 tokens, decode 1 token), shared by the tests."""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from jaxckpt.layers import load_params, param_dict  # noqa: E402
from jaxckpt.models import Qwen3NextForCausalLM, export_state, import_state  # noqa: E402
from jaxckpt.models.common import forward, from_hf_cache, hf_dynamic_cache, read_safetensors  # noqa: E402
from tests.models.hf_helpers import hf_cached_run, hf_logits, hf_modeling, randomize, rel_rms, step  # noqa: E402

PAGES, SLOTS, TOKENS = 24, 8, 64
TOL = 1e-5


@functools.cache
def _models(tmp_root="/tmp"):
    import tempfile

    config = transformers.Qwen3NextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8,
        num_experts_per_tok=2, mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                     "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    hf = hf_modeling("qwen3_next").Qwen3NextForCausalLM(config).eval()
    randomize(hf, seed=1)
    folder = tempfile.mkdtemp(prefix="qwen3_next_", dir=tmp_root)
    hf.save_pretrained(folder, max_shard_size="40KB")
    ours = Qwen3NextForCausalLM.from_pretrained(folder, implementation="xla", block_size=8, max_model_len=128,
                                                chunk_size=16)
    return hf, ours, folder


def _run(model, token_rows, caches, *, all_tokens=False, state=None, **meta_args):
    graphdef, own_state = nnx.split(model)
    decode = meta_args.get("num_decodes", 0) == len(token_rows)
    tokens, meta = step(model.config, token_rows, num_kv_pages=PAGES, num_state_slots=SLOTS,
                        num_tokens=len(token_rows) if decode else TOKENS, num_rows=4, num_checkpoints=4,
                        max_blocks=8, **meta_args)
    return forward(graphdef, own_state if state is None else state, tokens, meta, caches, all_tokens=all_tokens)


def _rows(seed, lengths, vocab=96):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _packed_logits(ours, rows, state=None):
    """Every token's logits of `rows` prefilled together from empty caches, split per row."""
    tables, page = [], 1
    for row in rows:
        need = -(-len(row) // 8)
        tables.append(list(range(page, page + need)))
        page += need
    logits, _ = _run(ours, rows, ours.init_caches(PAGES, SLOTS, fill=np.nan), all_tokens=True, state=state,
                     context_lens=[0] * len(rows), block_tables=tables, initial_state_indices=[0] * len(rows),
                     final_state_indices=list(range(1, len(rows) + 1)))
    bounds = np.cumsum([0] + [len(r) for r in rows])
    return [np.asarray(logits)[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def test_loads_sharded_files_by_their_names():
    hf, ours, folder = _models()
    files = read_safetensors(folder)
    assert any(name.startswith("model.layers.0.mlp.experts.7.") for name in files)  # the published per-expert names
    import json
    import os
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    ours_params = param_dict(ours)
    hf_params = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    np.testing.assert_array_equal(ours_params["model.layers.3.self_attn.q_proj.weight"],
                                  hf_params["model.layers.3.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(ours_params["model.layers.0.mlp.experts.down_proj"][5],
                                  hf_params["model.layers.0.mlp.experts.down_proj"][5].T)
    assert ours.checkpoint_alignment() == 1


def test_packed_rows_of_several_lengths_match_transformers():
    hf, ours, _ = _models()
    rows = _rows(0, [7, 19, 33])
    for row, logits in zip(rows, _packed_logits(ours, rows)):
        err = rel_rms(logits, hf_logits(hf, row))
        assert err <= TOL, f"row of {len(row)}: rel-RMS {err:.2e}"


def test_moe_routing_identical():
    hf, ours, _ = _models()
    captured = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, args, out: captured.append((args[0], out)))
             for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    try:
        hf_logits(hf, _rows(1, [40])[0])
    finally:
        for hook in hooks:
            hook.remove()
    moe_layers = [layer.mlp for layer in ours.model.layers if hasattr(layer.mlp, "route")]
    assert len(captured) == len(moe_layers) == 3
    for (inputs, (_, scores, indices)), block in zip(captured, moe_layers):
        weights, experts = block.route(inputs.detach().numpy().reshape(-1, inputs.shape[-1]))
        order = np.argsort(indices.numpy(), axis=-1)  # compare as sets per token, weights aligned
        np.testing.assert_array_equal(np.sort(np.asarray(experts), axis=-1), np.sort(indices.numpy(), axis=-1))
        ours_sorted = np.take_along_axis(np.asarray(weights), np.argsort(np.asarray(experts), axis=-1), axis=-1)
        np.testing.assert_allclose(ours_sorted, np.take_along_axis(scores.detach().numpy(), order, axis=-1),
                                   rtol=1e-5, atol=1e-6)


def test_checkpointed_prefill_resume_and_decode_match_transformers_cache():
    """Ours: one prefill of 30 tokens exporting checkpoints at 16 and 24; resume from the 16 one over tokens 16..30,
    then 3 decode steps. transformers: prefill 16, continue 14 in one call, decode 3, all on its own cache. The two
    caches at 16 convert into each other, and either side resumes from the other's."""
    hf, ours, _ = _models()
    prompt, decode_tokens = _rows(2, [30, 3])
    at_16, hf_continued, hf_decoded = hf_cached_run(hf, prompt[:16], prompt[16:], decode_tokens)

    caches = ours.init_caches(PAGES, SLOTS, fill=np.nan)
    first, caches = _run(ours, [prompt], caches, all_tokens=True, context_lens=[0], block_tables=[[1, 2, 3, 4]],
                         initial_state_indices=[0], final_state_indices=[1], checkpoint_cu=[0, 2],
                         checkpoint_offsets=[16, 24], checkpoint_state_indices=[2, 3])
    assert rel_rms(np.asarray(first)[:30], hf_logits(hf, prompt)) <= TOL

    # our checkpoint at 16 in transformers' layout equals transformers' own cache after 16 tokens
    exported = export_state(caches, slot=2, pages=[1, 2], num_tokens=16, block_size=8)
    theirs = from_hf_cache(at_16)
    for i, (a, b) in enumerate(zip(exported, theirs)):
        for key in a:
            columns = slice(1, None) if key == "conv" else slice(None)  # transformers' oldest conv column is unread
            err = rel_rms(a[key][..., columns], b[key][..., columns])
            assert err <= TOL, f"layer {i} {key}: rel-RMS {err:.2e}"

    # resume from our checkpoint (slot 2, pages 1-2 shared), then decode
    continued, caches = _run(ours, [prompt[16:]], caches, all_tokens=True, context_lens=[16],
                             block_tables=[[1, 2, 5, 6]], initial_state_indices=[2], final_state_indices=[4])
    assert rel_rms(np.asarray(continued)[:14], hf_continued) <= TOL
    table = [[1, 2, 5, 6, 7]]
    for n, token in enumerate(decode_tokens):
        logits, caches = _run(ours, [[token]], caches, context_lens=[30 + n], block_tables=table,
                              initial_state_indices=[4], final_state_indices=[4], num_decodes=1)
        err = rel_rms(np.asarray(logits)[0], hf_decoded[n])
        assert err <= TOL, f"decode step {n}: rel-RMS {err:.2e}"

    # transformers resumes from our exported checkpoint ...
    err = rel_rms(hf_logits(hf, prompt[16:], cache=hf_dynamic_cache(hf.config, exported)), hf_continued)
    assert err <= TOL, f"transformers from our checkpoint: rel-RMS {err:.2e}"
    # ... and we resume from transformers' cache, written into a fresh slot and fresh pages
    caches = import_state(ours.init_caches(PAGES, SLOTS, fill=np.nan), theirs, slot=5, pages=[8, 9], block_size=8)
    continued, _ = _run(ours, [prompt[16:]], caches, all_tokens=True, context_lens=[16],
                        block_tables=[[8, 9, 10, 11]], initial_state_indices=[5], final_state_indices=[6])
    err = rel_rms(np.asarray(continued)[:14], hf_continued)
    assert err <= TOL, f"ours from transformers' cache: rel-RMS {err:.2e}"


def _corrupted(ours, name, change):
    """The state of a copy of `ours` with parameter `name` changed (same graph and shapes: no recompile)."""
    copy = nnx.clone(ours)
    params = dict(param_dict(copy))
    load_params(copy, {name: change(params[name])}, strict=False)
    return nnx.split(copy)[1]


def _swap_experts(w):
    w = w.copy()
    w[[0, 1]] = w[[1, 0]]
    return w


def _ungrouped_qkvz(w):
    """in_proj_qkvz read as [all q | all k | all v | all z] instead of grouped per key head."""
    heads, parts = 2, [8, 8, 16, 16]
    grouped = w.reshape(heads, sum(parts), -1)
    return np.concatenate([grouped[:, sum(parts[:i]):sum(parts[:i + 1])].reshape(-1, w.shape[-1])
                           for i in range(4)])


def _swapped_query_gate(w):
    """q_proj's per-head [query | gate] read the other way round."""
    return w.reshape(4, 2, 16, -1)[:, ::-1].reshape(w.shape)


@pytest.mark.parametrize("name, change", [
    ("model.layers.0.mlp.experts.gate_up_proj", _swap_experts),
    ("model.layers.2.linear_attn.in_proj_qkvz.weight", _ungrouped_qkvz),
    ("model.layers.3.self_attn.q_proj.weight", _swapped_query_gate),
], ids=["swapped-experts", "ungrouped-qkvz", "swapped-query-gate"])
def test_negative_controls(name, change):
    hf, ours, _ = _models()
    rows = _rows(3, [7, 19, 33])
    errors = [rel_rms(logits, hf_logits(hf, row))
              for row, logits in zip(rows, _packed_logits(ours, rows, state=_corrupted(ours, name, change)))]
    assert max(errors) > 100 * TOL, f"{name} corrupted, still rel-RMS {errors}"


def test_bf16_folder_loads_in_bf16():
    import tempfile

    hf, _, _ = _models()
    folder = tempfile.mkdtemp(prefix="qwen3_next_bf16_")
    import copy
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(folder)
    ours = Qwen3NextForCausalLM.from_pretrained(folder, block_size=8, max_model_len=128)
    assert ours.config.dtype == "bfloat16"
    params = param_dict(ours)
    weight = params["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    assert weight.dtype == np.dtype("bfloat16")
    expected = hf.state_dict()["model.layers.0.linear_attn.in_proj_qkvz.weight"].to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(weight.astype(np.float32), expected)
    assert params["model.layers.0.linear_attn.A_log"].dtype == np.float32  # decay parameters stay fp32


def test_engine_serves_it_with_checkpoints():
    """The align-mode engine runs the loaded model unchanged; a prompt sharing 2 blocks with an earlier one resumes
    from the boundary state the first one exported mid-forward, and its first logits match transformers'."""
    from jaxckpt.engine import Engine, EngineConfig, HybridRunner

    hf, ours, _ = _models()
    shared, tail_a, tail_b = _rows(4, [19, 6, 9])
    engine = Engine(HybridRunner(ours, prefill_tokens=64, num_checkpoints=4),
                    EngineConfig(mode="several", num_kv_pages=PAGES, num_state_slots=SLOTS, max_new_tokens=2,
                                 max_num_scheduled_tokens=64))
    first, second = engine.run([shared + tail_a, shared + tail_b])
    assert first.checkpoints >= 2 and second.hit_tokens == 16 and second.prefill_tokens == 12
    for result, prompt in ((first, shared + tail_a), (second, shared + tail_b)):
        assert rel_rms(result.first_logits, hf_logits(hf, prompt)[-1]) <= TOL


def test_config_reads_the_published_form_and_rejects_what_it_cannot_run():
    from jaxckpt.models import Qwen3NextConfig

    published = dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                     num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                     linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                     linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                     shared_expert_intermediate_size=512, full_attention_interval=4, rope_theta=10000000,
                     partial_rotary_factor=0.25, rms_norm_eps=1e-6, hidden_act="silu", decoder_sparse_step=1,
                     mlp_only_layers=[], norm_topk_prob=True, torch_dtype="bfloat16")
    config = Qwen3NextConfig.from_hf(published, block_size=16)
    assert config.kinds == ("gdn", "gdn", "gdn", "attention") * 2
    assert config.rope_theta == 10000000 and config.rotary_dim == 64
    assert all(config.is_moe_layer(i) for i in range(8))
    for change, field in ((dict(model_type="qwen3"), "model_type"), (dict(hidden_act="gelu"), "hidden_act"),
                          (dict(rope_parameters={"rope_type": "yarn"}), "rope"),
                          (dict(layer_types=["linear_attention"] * 7), "layer_types"),
                          (dict(partial_rotary_factor=0.0), "partial_rotary_factor")):
        with pytest.raises(ValueError, match=field):
            Qwen3NextConfig.from_hf(published | change)
    with pytest.raises(ValueError, match="max_model_len"):
        Qwen3NextConfig.from_hf(published, block_size=16, max_model_len=1000)
