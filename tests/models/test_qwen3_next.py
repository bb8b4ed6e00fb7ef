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

from jaxckpt.models import Qwen3NextForCausalLM  # noqa: E402
from jaxckpt.models.common import read_safetensors  # noqa: E402
from tests.models.hf_helpers import (PAGES, SERVING, SLOTS, TOL, VOCAB, assert_caught,  # noqa: E402
                                     assert_loads_from_memory, assert_packed_rows_match, assert_same_as_transformers,
                                     assert_same_routing, bf16_params, capture_routing, check_checkpoint_resume,
                                     hf_logits, hf_modeling, random_rows, randomize, rel_rms, save_sharded, swapped)



@functools.cache
def _models():
    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8,
        num_experts_per_tok=2, mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                     "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    hf = hf_modeling("qwen3_next").Qwen3NextForCausalLM(config).eval()
    randomize(hf, seed=1)
    folder = save_sharded(hf, "qwen3_next_")
    return hf, Qwen3NextForCausalLM.from_pretrained(folder, **SERVING), folder


def test_loads_sharded_files_by_their_names():
    hf, ours, folder = _models()
    files = read_safetensors(folder)
    assert any(name.startswith("model.layers.0.mlp.experts.7.") for name in files)  # the published per-expert names
    import json
    import os
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    assert_same_as_transformers(hf, ours, "model.layers.3.self_attn.q_proj.weight",
                                experts="model.layers.0.mlp.experts.down_proj", expert=5)
    assert ours.checkpoint_alignment() == 1
    assert_loads_from_memory(hf, Qwen3NextForCausalLM, ours)  # transformers' fused experts


def test_packed_rows_of_several_lengths_match_transformers():
    assert_packed_rows_match(*_models()[:2], random_rows(0, [7, 19, 33]))


def test_moe_routing_identical():
    hf, ours, _ = _models()
    captured = capture_routing(hf, lambda layer: getattr(layer.mlp, "gate", None), random_rows(1, [40])[0])
    assert_same_routing(captured, [layer.mlp.route for layer in ours.model.layers if hasattr(layer.mlp, "route")])
    assert len(captured) == 3


def test_checkpointed_prefill_resume_and_decode_match_transformers_cache():
    """`hf_helpers.check_checkpoint_resume`: prefill 30 with checkpoints at 16 and 24, resume from 16, decode 3; the
    caches at 16 convert both ways."""
    hf, ours, _ = _models()
    prompt, decode_tokens = random_rows(2, [30, 3])
    check_checkpoint_resume(hf, ours, prompt, decode_tokens)


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
    ("model.layers.0.mlp.experts.gate_up_proj", swapped(0, 1)),
    ("model.layers.2.linear_attn.in_proj_qkvz.weight", _ungrouped_qkvz),
    ("model.layers.3.self_attn.q_proj.weight", _swapped_query_gate),
], ids=["swapped-experts", "ungrouped-qkvz", "swapped-query-gate"])
def test_negative_controls(name, change):
    assert_caught(*_models()[:2], name, change, random_rows(3, [7, 19, 33]))


def test_bf16_folder_loads_in_bf16():
    hf, _, _ = _models()
    params = bf16_params(hf, Qwen3NextForCausalLM, "qwen3_next_bf16_")
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
    shared, tail_a, tail_b = random_rows(4, [19, 6, 9])
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


def test_demo_serves_the_folder(capsys):
    """`jaxckpt demo --model DIR` loads the folder by its config's model_type and serves it in every mode; the demo
    itself checks each request's first logits against the uncached forward (exit status 1 on a miss)."""
    from jaxckpt.engine.demo import main

    _, _, folder = _models()
    status = main(["--model", folder, "--block-size", "8", "--families", "1", "--members", "2", "--conversations", "0",
                   "--unique-tails", "2", "--max-new-tokens", "2", "--tolerance", "1e-5", "--no-progress"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "Qwen3NextForCausalLM" in out and "parity: " in out


def test_demo_names_a_folder_it_cannot_serve(tmp_path, capsys):
    from jaxckpt.engine.demo import main

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert main(["--model", str(tmp_path), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert "--model: " in err and "'llama'" in err, err
