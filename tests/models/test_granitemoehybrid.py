"""GraniteMoeHybrid (granite-4.0-h) against transformers' own `GraniteMoeHybridForCausalLM`: a tiny random model
(Mamba2 layers with 2 groups, RoPE attention, MoE beside the shared MLP, Granite's four multipliers) saved by
`save_pretrained` in several shards and loaded by the files' names, and a NoPE, dense, tied-embedding variant; fp32
logits of rows of several lengths in one packed batch; MoE routing; a checkpointed prefill, a resume and three decode
steps against transformers' cached path; cache conversion both ways; negative controls."""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxckpt.models import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM  # noqa: E402
from tests.models.hf_helpers import (SERVING, VOCAB, assert_caught, assert_in_files,  # noqa: E402
                                     assert_loads_from_memory, assert_packed_rows_match, assert_reference_logits_match,
                                     assert_same_as_transformers, assert_same_routing, capture_routing,
                                     check_checkpoint_resume, hf_modeling, random_rows, randomize, save_sharded,
                                     swapped)

HEADS, D_HEAD, GROUPS, STATE = 8, 8, 2, 8


def _config(**overrides):
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, shared_intermediate_size=24, num_local_experts=8, num_experts_per_tok=2,
                  mamba_n_heads=HEADS, mamba_n_groups=GROUPS, mamba_d_state=STATE, mamba_d_head=D_HEAD,
                  mamba_expand=2, mamba_d_conv=4, layer_types=["mamba", "attention", "mamba", "mamba"],
                  position_embedding_type="rope", embedding_multiplier=2.0, logits_scaling=3.0,
                  residual_multiplier=0.7, attention_multiplier=0.3, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    return transformers.GraniteMoeHybridConfig(**(fields | overrides))


_VARIANTS = {"moe": {}, "dense": dict(num_local_experts=0, position_embedding_type=None, tie_word_embeddings=True,
                                      layer_types=["attention", "mamba", "mamba", "attention"])}


@functools.cache
def _models(variant="moe"):
    torch.manual_seed(0)
    hf = hf_modeling("granitemoehybrid").GraniteMoeHybridForCausalLM(_config(**_VARIANTS[variant])).eval()
    randomize(hf, seed=1)
    folder = save_sharded(hf, f"granitemoehybrid_{variant}_")
    return hf, GraniteMoeHybridForCausalLM.from_pretrained(folder, **SERVING), folder


def test_loads_the_files_by_their_names():
    hf, ours, folder = _models()
    assert_in_files(folder, ("model.layers.0.block_sparse_moe.input_linear.weight",
                             "model.layers.0.block_sparse_moe.router.layer.weight",
                             "model.layers.2.mamba.conv1d.weight"))
    assert_same_as_transformers(hf, ours, "model.layers.2.mamba.in_proj.weight",
                                experts="model.layers.1.block_sparse_moe.experts.gate_up_proj", expert=3)
    assert ours.checkpoint_alignment() == 1
    assert_loads_from_memory(hf, GraniteMoeHybridForCausalLM, ours)


@pytest.mark.parametrize("variant", ["moe", "dense"])
def test_packed_rows_of_several_lengths_match_transformers(variant):
    assert_packed_rows_match(*_models(variant)[:2], random_rows(0, [7, 19, 33]))


def test_reference_logits_match_transformers():
    assert_reference_logits_match(*_models()[:2], random_rows(6, [21])[0])


def test_moe_routing_identical():
    hf, ours, _ = _models()
    captured = capture_routing(hf, lambda layer: layer.block_sparse_moe.router, random_rows(1, [40])[0])
    assert_same_routing(captured, [layer.block_sparse_moe.route for layer in ours.model.layers])
    assert len(captured) == 4


@pytest.mark.parametrize("variant", ["moe", "dense"])
def test_checkpointed_prefill_resume_and_decode_match_transformers_cache(variant):
    """`hf_helpers.check_checkpoint_resume`: prefill 30 with checkpoints at 16 and 24, resume from 16, decode 3; the
    caches at 16 (Mamba2 conv windows and SSM states, keys and values) convert both ways."""
    hf, ours, _ = _models(variant)
    prompt, decode_tokens = random_rows(2, [30, 3])
    check_checkpoint_resume(hf, ours, prompt, decode_tokens)


def _swapped_groups(w):
    """in_proj's B rows of group 0 and group 1 exchanged (a mis-grouped B)."""
    d_ssm = HEADS * D_HEAD
    w = w.copy()
    b = slice(2 * d_ssm, 2 * d_ssm + GROUPS * STATE)
    w[b] = w[b].reshape(GROUPS, STATE, -1)[::-1].reshape(GROUPS * STATE, -1)
    return w


def _swapped_gate_up(w):
    """The shared MLP's input_linear read as [up | gate]."""
    return np.concatenate(np.split(w, 2)[::-1])


@pytest.mark.parametrize("name, change", [
    ("model.layers.2.block_sparse_moe.experts.gate_up_proj", swapped(1, 6)),
    ("model.layers.0.mamba.in_proj.weight", _swapped_groups),
    ("model.layers.1.shared_mlp.input_linear.weight", _swapped_gate_up),
], ids=["swapped-experts", "swapped-mamba-groups", "swapped-gate-up"])
def test_negative_controls(name, change):
    assert_caught(*_models()[:2], name, change, random_rows(3, [7, 19, 33]))


def test_config_reads_the_published_form_and_rejects_what_it_cannot_run():
    published = dict(model_type="granitemoehybrid", vocab_size=100352, hidden_size=1536, intermediate_size=512,
                     num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=48,
                     mamba_d_head="auto", mamba_d_state=128, mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4,
                     mamba_conv_bias=True, mamba_proj_bias=False, num_local_experts=64, num_experts_per_tok=6,
                     shared_intermediate_size=1024, position_embedding_type="nope", embedding_multiplier=12,
                     logits_scaling=6, residual_multiplier=0.22, attention_multiplier=0.0078125,
                     layer_types=["mamba", "mamba", "mamba", "attention"], tie_word_embeddings=True,
                     hidden_act="silu", rms_norm_eps=1e-5, torch_dtype="bfloat16",
                     time_step_limit=[0.0, {"__float__": "Infinity"}])
    config = GraniteMoeHybridConfig.from_hf(published, block_size=16)
    assert config.kinds == ("mamba2", "mamba2", "mamba2", "attention")
    assert config.mamba_d_head == 64 and config.head_dim == 128
    for change, field in ((dict(model_type="granitemoe"), "model_type"), (dict(hidden_act="gelu"), "hidden_act"),
                          (dict(mamba_conv_bias=False), "mamba_conv_bias"),
                          (dict(time_step_limit=[0.0, 0.1]), "time_step_limit"),
                          (dict(layer_types=["mamba", "moe", "mamba", "attention"]), "layer_types"),
                          (dict(mamba_d_head=32), "mamba_d_head"),
                          (dict(position_embedding_type="alibi"), "position_embedding_type"),
                          (dict(num_experts_per_tok=65), "num_experts_per_tok")):
        with pytest.raises(ValueError, match=field):
            GraniteMoeHybridConfig.from_hf(published | change)
