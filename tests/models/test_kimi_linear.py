"""Kimi-Linear against transformers' own `KimiLinearForCausalLM`: a tiny random model (KDA and MLA layers, a dense MLP
layer, MoE layers with group-limited sigmoid routing and a shared expert, a q-LoRA variant) saved by
`save_pretrained` in several shards and loaded by the files' names; fp32 logits of rows of several lengths in one
packed batch; MoE routing; a checkpointed prefill, a resume and three decode steps against transformers' cached path;
cache conversion both ways; negative controls that show each comparison catches a wrong weight."""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxckpt.layers import param_dict  # noqa: E402
from jaxckpt.models import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402
from tests.models.hf_helpers import (SERVING, VOCAB, assert_caught, assert_in_files,  # noqa: E402
                                     assert_loads_from_memory, assert_packed_rows_match, assert_reference_logits_match,
                                     assert_same_as_transformers, assert_same_routing, bf16_params, capture_routing,
                                     check_checkpoint_resume, hf_modeling, hf_state, random_rows, randomize,
                                     save_sharded, swapped)

HEADS, NOPE, ROPE, V_DIM, RANK = 4, 8, 8, 12, 16


def _config(**overrides):
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=4, num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=RANK,
                  q_lora_rank=None, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V_DIM, n_group=4,
                  topk_group=2, num_experts_per_tok=3, num_local_experts=8, n_shared_experts=2,
                  routed_scaling_factor=2.5, linear_head_dim=8, linear_num_heads=4,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                  mlp_layer_types=["dense", "sparse", "sparse", "sparse"], pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    return transformers.KimiLinearConfig(**(fields | overrides))


@functools.cache
def _models(q_lora_rank=None):
    torch.manual_seed(0)
    hf = hf_modeling("kimi_linear").KimiLinearForCausalLM(_config(q_lora_rank=q_lora_rank)).eval()
    randomize(hf, seed=1)
    with torch.no_grad():  # a correction bias that moves choices: routing must add it to choose, not to weigh
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8))
    folder = save_sharded(hf, "kimi_linear_")
    return hf, KimiLinearForCausalLM.from_pretrained(folder, **SERVING), folder


def test_loads_the_files_by_their_names():
    hf, ours, folder = _models()
    assert_in_files(folder, ("model.layers.1.block_sparse_moe.experts.7.w3.weight",
                             "model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.A_log",
                             "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"))
    assert_same_as_transformers(hf, ours, "model.layers.1.self_attn.kv_b_proj.weight",
                                experts="model.layers.2.mlp.experts.gate_up_proj", expert=5)
    ours_params, hf_params = param_dict(ours), hf_state(hf)
    np.testing.assert_array_equal(np.concatenate([ours_params[f"model.layers.0.self_attn.{n}_conv1d.weight"]
                                                  for n in "qkv"]),
                                  hf_params["model.layers.0.self_attn.conv1d.weight"][:, 0])
    np.testing.assert_array_equal(ours_params["model.layers.2.self_attn.A_log"],
                                  hf_params["model.layers.2.self_attn.forget_gate.A_log"].reshape(-1))
    assert ours.checkpoint_alignment() == 1
    # transformers' in-memory state dict (nested forget gate, fused convs and experts, `mlp`) loads the same model
    assert_loads_from_memory(hf, KimiLinearForCausalLM, ours)


def test_packed_rows_of_several_lengths_match_transformers():
    assert_packed_rows_match(*_models()[:2], random_rows(0, [7, 19, 33]))


def test_q_lora_variant_matches_transformers():
    hf, ours, _ = _models(q_lora_rank=12)
    assert "model.layers.1.self_attn.q_a_layernorm.weight" in param_dict(ours)
    assert_packed_rows_match(hf, ours, random_rows(5, [11, 26]))


def test_reference_logits_match_transformers():
    """The uncached oracle (MLA with keys and values expanded per head, float64 KDA) agrees as well."""
    assert_reference_logits_match(*_models()[:2], random_rows(6, [21])[0])


def test_moe_routing_identical():
    hf, ours, _ = _models()
    captured = capture_routing(hf, lambda layer: getattr(layer.mlp, "gate", None), random_rows(1, [40])[0])
    assert_same_routing(captured, [layer.mlp.route for layer in ours.model.layers if hasattr(layer.mlp, "route")])
    assert len(captured) == 3
    # the bias changed some choices: without it, routing differs somewhere
    moe = ours.model.layers[1].mlp
    biased = np.sort(np.asarray(moe.route(captured[0][0])[1]), axis=-1)
    bias = moe.gate.e_score_correction_bias.get_value()
    moe.gate.e_score_correction_bias.set_value(bias * 0)
    try:
        assert not np.array_equal(np.sort(np.asarray(moe.route(captured[0][0])[1]), axis=-1), biased)
    finally:
        moe.gate.e_score_correction_bias.set_value(bias)


def test_checkpointed_prefill_resume_and_decode_match_transformers_cache():
    """`hf_helpers.check_checkpoint_resume`: prefill 30 with checkpoints at 16 and 24, resume from 16, decode 3; the
    caches at 16 (KDA conv windows and states, MLA latents and shared keys) convert both ways."""
    hf, ours, _ = _models()
    prompt, decode_tokens = random_rows(2, [30, 3])
    check_checkpoint_resume(hf, ours, prompt, decode_tokens)


def _misgrouped_kv_b(w):
    """kv_b_proj read as [all W_uk | all W_uv] instead of [W_uk | W_uv] per head."""
    grouped = w.reshape(HEADS, NOPE + V_DIM, RANK)
    return np.concatenate([grouped[:, :NOPE].reshape(-1, RANK), grouped[:, NOPE:].reshape(-1, RANK)])


def _swapped_latent_and_rope(w):
    """kv_a_proj_with_mqa's output read as [k_rope | latent]."""
    return np.concatenate([w[RANK:], w[:RANK]])


def _permuted_conv(w):
    return w[::-1].copy()


@pytest.mark.parametrize("name, change", [
    ("model.layers.2.mlp.experts.gate_up_proj", swapped(2, 5)),
    ("model.layers.1.self_attn.kv_b_proj.weight", _misgrouped_kv_b),
    ("model.layers.3.self_attn.kv_a_proj_with_mqa.weight", _swapped_latent_and_rope),
    ("model.layers.0.self_attn.k_conv1d.weight", _permuted_conv),
], ids=["swapped-experts", "misgrouped-kv_b", "swapped-latent-rope", "permuted-k-conv"])
def test_negative_controls(name, change):
    assert_caught(*_models()[:2], name, change, random_rows(3, [7, 19, 33]))


def test_bf16_folder_loads_in_bf16():
    params = bf16_params(_models()[0], KimiLinearForCausalLM, "kimi_linear_bf16_")
    assert params["model.layers.1.self_attn.kv_b_proj.weight"].dtype == np.dtype("bfloat16")
    # the router and the decay parameters stay fp32, as in transformers
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.layers.0.self_attn.A_log", "model.layers.0.self_attn.dt_bias"):
        assert params[name].dtype == np.float32, name


def test_config_reads_the_published_form_and_rejects_what_it_cannot_run():
    published = dict(model_type="kimi_linear", vocab_size=163840, hidden_size=2304, intermediate_size=9216,
                     moe_intermediate_size=1024, num_hidden_layers=8, num_attention_heads=32,
                     num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                     qk_rope_head_dim=64, v_head_dim=128, num_experts=256, num_experts_per_token=8,
                     num_shared_experts=1, num_expert_group=1, topk_group=1, moe_renormalize=True,
                     routed_scaling_factor=2.446, first_k_dense_replace=1, moe_layer_freq=1,
                     moe_router_activation_func="sigmoid", mla_use_nope=True, rms_norm_eps=1e-5, hidden_act="silu",
                     linear_attn_config={"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7],
                                         "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
                     torch_dtype="bfloat16")
    config = KimiLinearConfig.from_hf(published, block_size=16)
    assert config.kinds == ("kda", "kda", "kda", "attention") * 2
    assert config.mlp_layer_types == ("dense",) + ("sparse",) * 7
    assert (config.num_local_experts, config.num_experts_per_tok, config.n_shared_experts) == (256, 8, 1)
    assert (config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim) == (32, 128, 4)
    for change, field in ((dict(model_type="deepseek_v3"), "model_type"), (dict(hidden_act="gelu"), "hidden_act"),
                          (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
                          (dict(mla_use_nope=False), "mla_use_nope"),
                          (dict(num_key_value_heads=8), "num_key_value_heads"),
                          (dict(num_expert_group=3), "n_group"),
                          (dict(num_expert_group=8, topk_group=9), "topk_group"),
                          (dict(num_experts_per_token=300), "num_experts_per_tok")):
        with pytest.raises(ValueError, match=field):
            KimiLinearConfig.from_hf(published | change)
    with pytest.raises(ValueError, match="^attention_implementation"):  # MLA has one path
        KimiLinearConfig.from_hf(published, attention_implementation="xla")
