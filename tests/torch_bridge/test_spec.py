"""torch_bridge.spec without vLLM: per-backend alignments, the all-or-nothing derivation, the no-vLLM spec path."""

import subprocess
import sys

import numpy as np
import pytest

from jaxckpt.plan import checkpoint_grid, prefill_checkpoints
from jaxckpt.plan.spec import StateSpec
from torch_bridge import spec as tb


class Layer(tb.RecurrentLayer):
    """A stand-in layer: conv [D, W - 1] + recurrent [HV, K, V] state with a fixed declared alignment."""

    def __init__(self, alignment, *, dtypes=("bfloat16", "float32"), mamba_type="gdn_attn"):
        self.alignment = alignment
        self.dtypes = dtypes
        self.mamba_type = mamba_type

    def get_state_shape(self):
        return ((3, 256), (4, 32, 32))

    def get_state_dtype(self):
        return self.dtypes

    def get_prefill_checkpoint_alignment(self):
        return self.alignment


def test_declared_alignments_and_their_conditions():
    assert tb.mamba2_alignment() == 1
    assert tb.split_checkpoint_alignment() == 1
    assert tb.fla_kda_alignment() == 64
    assert tb.flashinfer_gdn_alignment(gdn_prefill_backend="flashinfer", mamba_cache_mode="align") == 64
    for backend, mode in (("flashinfer", "none"), ("flashinfer", "all"), ("triton", "align"), ("cutedsl", "align")):
        assert tb.flashinfer_gdn_alignment(gdn_prefill_backend=backend, mamba_cache_mode=mode) is None
    assert tb.short_conv_alignment(mamba_cache_mode="align") == 1
    assert tb.short_conv_alignment(mamba_cache_mode="all") is None
    assert tb.flashkda_alignment(kda_prefill_backend="flashkda") == 16
    assert tb.flashkda_alignment(kda_prefill_backend="triton") is None
    assert tb.bridge_alignment() == 1
    capable = dict(kda_prefill_backend="fused", use_safe_gate=True, num_speculative_tokens=0)
    assert tb.rocm_fused_kda_alignment(**capable) == 64
    for change in ({"kda_prefill_backend": "triton"}, {"kda_prefill_backend": "gluon"}, {"use_safe_gate": False},
                   {"num_speculative_tokens": 1}, {"use_prefill_checkpoint": False}):
        assert tb.rocm_fused_kda_alignment(**{**capable, **change}) is None, change
    with pytest.raises(ValueError, match="^mamba_cache_mode"):
        tb.flashinfer_gdn_alignment(gdn_prefill_backend="flashinfer", mamba_cache_mode="aligned")
    with pytest.raises(ValueError, match="^num_speculative_tokens"):
        tb.rocm_fused_kda_alignment(**{**capable, "num_speculative_tokens": -1})


def test_rocm_kda_drafts_rule_is_ours_and_none_is_vllms():
    # Deviation 5: an int draft count declines with drafts; None is vLLM 0.33's rule (what the plugin declares).
    vllm_rule = dict(kda_prefill_backend="fused", use_safe_gate=True, num_speculative_tokens=None)
    assert tb.rocm_fused_kda_alignment(**vllm_rule) == 64
    assert tb.rocm_fused_kda_alignment(**{**vllm_rule, "num_speculative_tokens": 2}) is None
    assert tb.rocm_fused_kda_alignment(**{**vllm_rule, "use_safe_gate": False}) is None


def test_published_grid_and_flashinfer_planning():
    assert tb.vllm_published_alignment(64, prefix_match_unit=None, block_size=1024) == 1024
    assert tb.vllm_published_alignment(64, prefix_match_unit=48, block_size=1024) == 192
    assert tb.vllm_published_alignment(1, prefix_match_unit=16, block_size=1024) == 16
    with pytest.raises(ValueError, match="^alignment"):
        tb.vllm_published_alignment(None, prefix_match_unit=16, block_size=1024)
    assert tb.plans_flashinfer_checkpoints(64) and tb.plans_flashinfer_checkpoints(192)
    assert not tb.plans_flashinfer_checkpoints(16) and not tb.plans_flashinfer_checkpoints(None)


def test_derivation_is_all_or_nothing_and_the_lcm():
    layers = {"a": Layer(16), "b": Layer(64), "c": Layer(1)}
    specs = tb.derive_model_specs(layers, block_size=1024, mamba_cache_mode="align")
    assert list(specs) == ["a", "b", "c"]
    assert {(s.num_prefill_checkpoint_blocks, s.prefill_checkpoint_alignment) for s in specs.values()} == {(1, 64)}
    assert tb.model_alignment(layers) == 64
    layers["d"] = Layer(None)
    specs = tb.derive_model_specs(layers, block_size=1024, mamba_cache_mode="align")
    assert {(s.num_prefill_checkpoint_blocks, s.prefill_checkpoint_alignment) for s in specs.values()} == {(0, None)}
    assert tb.model_alignment(layers) is None
    for mode in ("none", "all"):
        specs = tb.derive_model_specs([Layer(1), Layer(16)], block_size=1024, mamba_cache_mode=mode)
        assert [(s.num_prefill_checkpoint_blocks, s.prefill_checkpoint_alignment) for s in specs] == [(0, None)] * 2
    extended = tb.derive_model_specs([Layer(1)], block_size=64, mamba_cache_mode="align", max_checkpoints_per_row=3)
    assert (extended[0].num_prefill_checkpoint_blocks, extended[0].prefill_checkpoint_alignment) == (3, 1)


def test_layer_spec_is_the_model_derivation():
    layers = [Layer(16, dtypes=("float32", "float32")), Layer(64, mamba_type="short_conv")]
    kwargs = dict(block_size=512, mamba_cache_mode="align", num_speculative_blocks=2, page_size_padded=1 << 20)
    specs = tb.derive_model_specs(layers, **kwargs)
    for layer, spec in zip(layers, specs):
        assert layer.get_kv_cache_spec(layers, **kwargs) == spec
    spec = specs[1]
    assert spec.shapes == ((3, 256), (4, 32, 32)) and spec.dtypes == ("bfloat16", "float32")
    assert spec.mamba_type == "short_conv" and spec.num_speculative_blocks == 2
    assert spec.state_content_size_bytes == 3 * 256 * 2 + 4 * 32 * 32 * 4
    assert spec.max_memory_usage_bytes() == (1 << 20) * (2 + 2 + 1)
    assert specs[0].state_content_size_bytes != spec.state_content_size_bytes
    assert specs[0].is_uniform_with_collection({"b": spec})  # the padded pages agree, so one KV-cache group
    with pytest.raises(ValueError, match="^model_layers"):
        Layer(1).get_kv_cache_spec(layers, **kwargs)
    with pytest.raises(ValueError, match="^layers"):
        tb.derive_model_specs([Layer(1), object()], block_size=64, mamba_cache_mode="align")


def test_torch_dtypes_and_the_state_spec_hook():
    torch = pytest.importorskip("torch")

    class TorchLayer(Layer):
        def get_state_dtype(self):
            return (torch.bfloat16, torch.float32)

    class HookLayer(tb.RecurrentLayer):
        def state_spec(self, *, block_size, mamba_cache_mode, num_speculative_blocks=0, page_size_padded=None):
            return StateSpec(block_size=block_size, shapes=((8, 3),), dtypes=("float32",),
                             mamba_cache_mode=mamba_cache_mode, mamba_type="short_conv")

        def get_prefill_checkpoint_alignment(self):
            return 1

    specs = tb.derive_model_specs([TorchLayer(64), HookLayer()], block_size=256, mamba_cache_mode="align")
    assert specs[0].dtypes == ("bfloat16", "float32")
    assert specs[1].shapes == ((8, 3),) and specs[1].prefill_checkpoint_alignment == 64
    with pytest.raises(NotImplementedError):
        tb.RecurrentLayer().state_spec(block_size=16, mamba_cache_mode="align")
    assert tb.RecurrentLayer().get_prefill_checkpoint_alignment() is None
    with pytest.raises(ValueError, match="^dtypes"):
        tb.dtype_name(torch.int32)


def test_checkpoint_fields_cannot_disagree():
    base = dict(block_size=64, shapes=((2, 3),), dtypes=("float32",), mamba_cache_mode="align")
    with pytest.raises(ValueError, match="^num_prefill_checkpoint_blocks"):
        StateSpec(**base, num_prefill_checkpoint_blocks=1)
    with pytest.raises(ValueError, match="^num_prefill_checkpoint_blocks"):
        StateSpec(**base, prefill_checkpoint_alignment=16)


@pytest.mark.parametrize("block_size,prefix_match_unit,alignment", [
    (1024, None, 64), (1024, 16, 64), (1536, 48, 64), (1600, 16, 1), (1152, 1152, 16), (768, 64, 64), (256, 32, 16)])
def test_lcm_alignment_equals_the_published_grid_when_the_hash_unit_is_the_prefix_match_unit(
        block_size, prefix_match_unit, alignment):
    # vLLM 0.33 publishes the grid lcm(H, A) (or B); we publish A. Positions and query starts are on the H grid, so
    # (position - query_start) % A == 0 exactly when it is 0 modulo lcm(H, A): every checkpoint decision agrees.
    rng = np.random.default_rng(block_size + alignment + (prefix_match_unit or 0))
    hash_unit = block_size if prefix_match_unit is None else prefix_match_unit
    grid = checkpoint_grid(alignment, prefix_match_unit=prefix_match_unit, block_size=block_size)
    starts = rng.integers(0, 8, 4000) * hash_unit + rng.integers(0, 3, 4000) * (rng.random(4000) < 0.1)
    ends = starts + rng.integers(1, 5 * block_size, 4000)
    for drop_eagle_block in (False, True):
        ours = prefill_checkpoints(starts, ends, hash_block_size=hash_unit, block_size=block_size,
                                   alignment=alignment, drop_eagle_block=drop_eagle_block)
        theirs = prefill_checkpoints(starts, ends, hash_block_size=hash_unit, block_size=block_size,
                                     alignment=grid, drop_eagle_block=drop_eagle_block)
        np.testing.assert_array_equal(ours[0], theirs[0])
        np.testing.assert_array_equal(ours[1], theirs[1])
        assert np.count_nonzero(ours[0]) > 100


def test_the_grid_differs_when_the_hash_unit_is_finer_than_the_prefix_match_unit():
    ours = prefill_checkpoints([0], [1000], hash_block_size=16, block_size=256, alignment=16)
    theirs = prefill_checkpoints([0], [1000], hash_block_size=16, block_size=256,
                                 alignment=checkpoint_grid(16, prefix_match_unit=48, block_size=256))
    assert ours[0][0] == 992 and theirs[0][0] == 0


def test_to_vllm_spec_without_vllm_returns_our_spec():
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'vllm':
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
from jaxckpt.plan.spec import StateSpec
from torch_bridge.spec import to_vllm_spec, vllm_available
spec = StateSpec(block_size=64, shapes=((2, 3),), dtypes=('float32',), mamba_cache_mode='align',
                 num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=16)
assert not vllm_available()
assert to_vllm_spec(spec) is spec
print('ok')
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    with pytest.raises(ValueError, match="^spec"):
        tb.to_vllm_spec({"block_size": 64})
