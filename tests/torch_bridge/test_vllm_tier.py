"""torch_bridge.spec against vLLM 0.33.0 itself: its helpers and its real layer classes' `get_kv_cache_spec`.

Runs only where vLLM 0.33.0 imports (a throwaway environment, see tools/vllm_answers.py; the layer modules also need
einops, compressed-tensors and loguru); skips everywhere else. Layers are vLLM's own classes with `__init__` replaced
by a stub that sets only what `get_kv_cache_spec` reads. Where our derivation deviates on purpose (torch_bridge
README.md), the test asserts the documented relation instead of equality.
"""

import dataclasses

import pytest

vllm = pytest.importorskip("vllm")
if vllm.__version__ != "0.33.0":
    pytest.skip(f"needs vLLM 0.33.0, found {vllm.__version__}", allow_module_level=True)

import torch  # noqa: E402
from vllm.model_executor.layers.mamba import abstract  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

from jaxckpt.plan.spec import StateSpec  # noqa: E402
from tests.torch_bridge.vllm_helpers import vllm_config, vllm_layer, vllm_module  # noqa: E402
from torch_bridge import spec as tb  # noqa: E402

MODES = ("align", "none", "all")
GDN_SHAPES = ((3, 2048), (8, 128, 128))
GDN_DTYPES = (torch.bfloat16, torch.float32)
GDN_STATE = (GDN_SHAPES, GDN_DTYPES)


class Ours(tb.RecurrentLayer):
    def __init__(self, alignment, *, shapes=GDN_SHAPES, dtypes=GDN_DTYPES, mamba_type="gdn_attn",
                 tp_replicated=False):
        self.alignment, self.shapes, self.dtypes = alignment, shapes, dtypes
        self.mamba_type, self.tp_replicated = mamba_type, tp_replicated

    def get_state_shape(self):
        return self.shapes

    def get_state_dtype(self):
        return self.dtypes

    def get_prefill_checkpoint_alignment(self):
        return self.alignment


def derive(ours, cfg):
    cache = cfg.cache_config
    return tb.derive_model_specs(ours, block_size=cache.mamba_block_size, mamba_cache_mode=cache.mamba_cache_mode,
                                 num_speculative_blocks=cfg.num_speculative_tokens,
                                 page_size_padded=cache.mamba_page_size_padded)


def fields(spec):
    return spec.num_prefill_checkpoint_blocks, spec.prefill_checkpoint_alignment


def same_but_checkpoint_fields(theirs: StateSpec, ours: StateSpec):
    strip = dict(num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None)
    assert dataclasses.replace(theirs, **strip) == dataclasses.replace(ours, **strip)


def test_constants_and_helper_functions():
    gdn_attn = vllm_module("vllm.v1.attention.backends.gdn_attn")
    assert tb.FLASHINFER_GDN_ALIGNMENT == gdn_attn.FLASHINFER_GDN_CHECKPOINT_ALIGNMENT
    kda_checkpoint = vllm_module("vllm.model_executor.layers.mamba.kda_checkpoint")
    for backend in ("flashkda", "triton", "auto"):
        assert tb.flashkda_alignment(kda_prefill_backend=backend) == \
            kda_checkpoint.kda_prefill_checkpoint_alignment(backend)
    kda_chunk = vllm_module("vllm.models.kimi_k3.amd.ops.kda_chunk")
    assert tb.ROCM_FUSED_KDA_ALIGNMENT == kda_chunk.KDA_CHECKPOINT_ALIGNMENT


class Declared(abstract.MambaBase):
    """The smallest MambaBase: only a declared alignment, for vLLM's model-level helpers."""

    def __init__(self, alignment):
        self.alignment = alignment

    def get_state_shape(self):
        return GDN_SHAPES

    def get_state_dtype(self):
        return GDN_DTYPES

    @property
    def mamba_type(self):
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_prefill_checkpoint_alignment(self):
        return self.alignment


@pytest.mark.parametrize("alignments", [[], [1], [1, 16, 64], [64, 64], [16, None], [None], [48, 64, 1]])
@pytest.mark.parametrize("prefix_match_unit", [None, 16, 48, 1024])
def test_model_alignment_and_grid_helpers(alignments, prefix_match_unit):
    cfg = vllm_config("align", prefix_match_unit=prefix_match_unit)
    cfg.compilation_config.static_forward_context.update({f"l{i}": Declared(a) for i, a in enumerate(alignments)})
    theirs = abstract.get_mamba_prefill_checkpoint_alignment(cfg)
    ours = tb.model_alignment([Ours(a) for a in alignments])
    assert ours == theirs
    if theirs is not None:
        assert tb.vllm_published_alignment(ours, prefix_match_unit=prefix_match_unit, block_size=1024) == \
            abstract.get_mamba_prefill_checkpoint_grid(cfg)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_spec", [0, 2])
def test_mamba2_mixer(mode, num_spec):
    mixer2 = vllm_module("vllm.model_executor.layers.mamba.mamba_mixer2")
    cfg = vllm_config(mode, num_speculative_tokens=num_spec, page_size_padded=1 << 22)
    shapes, dtypes = ((3, 4096), (64, 64, 128)), (torch.bfloat16, torch.float32)
    layers = [vllm_layer(mixer2.MambaMixer2, cfg, f"m{i}", (shapes, dtypes)) for i in range(2)]
    ours = derive([Ours(tb.mamba2_alignment(), shapes=shapes, dtypes=dtypes,
                        mamba_type="mamba2") for _ in layers], cfg)
    for layer, our in zip(layers, ours):
        theirs = tb.from_vllm_spec(layer.get_kv_cache_spec(cfg))
        if mode == "align":
            assert theirs == our
        else:  # 0.33 opts in in every mode and every reader ignores it outside align; we derive (0, None) there
            assert fields(theirs) == (1, 1) and fields(our) == (0, None)
            same_but_checkpoint_fields(theirs, our)
            assert theirs.max_memory_usage_bytes() == our.max_memory_usage_bytes()
            assert theirs.max_num_blocks_per_req(10_000) == our.max_num_blocks_per_req(10_000)


def gdn_layer(module, cfg, name, backend):
    # What QwenGatedDeltaNetAttention.__init__ decides: FlashInfer exports, in align mode only.
    exports = cfg.cache_config.mamba_cache_mode == "align" and backend == "flashinfer"
    return vllm_layer(module.QwenGatedDeltaNetAttention, cfg, name, GDN_STATE, vllm_config=cfg,
                      gdn_prefill_backend=backend,
                      _checkpoint_alignment=tb.FLASHINFER_GDN_ALIGNMENT if exports else None)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefix_match_unit", [None, 64, 48])
@pytest.mark.parametrize("with_short_conv", [False, True])
def test_flashinfer_gdn_and_the_ple_short_conv(mode, prefix_match_unit, with_short_conv):
    gdn = vllm_module("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn")
    block_size = 1536
    cfg = vllm_config(mode, block_size=block_size, prefix_match_unit=prefix_match_unit)
    layers = [gdn_layer(gdn, cfg, f"g{i}", "flashinfer") for i in range(2)]
    ours = [Ours(tb.flashinfer_gdn_alignment(gdn_prefill_backend="flashinfer", mamba_cache_mode=mode))
            for _ in layers]
    if with_short_conv:
        ple = vllm_module("vllm.models.qwen4_exp.nvidia.ple_layer")
        conv_shapes, conv_dtypes = ((1024, 3),), (torch.bfloat16,)
        layers.append(vllm_layer(ple.Qwen4ExpPLELayer, cfg, "ple", (conv_shapes, conv_dtypes),
                                 cache_config=cfg.cache_config, conv_state_len=3))
        ours.append(Ours(tb.short_conv_alignment(mamba_cache_mode=mode), shapes=conv_shapes, dtypes=conv_dtypes,
                         mamba_type="short_conv", tp_replicated=True))
    derived = derive(ours, cfg)
    for layer, our in zip(layers, derived):
        theirs = tb.from_vllm_spec(layer.get_kv_cache_spec(cfg))
        same_but_checkpoint_fields(theirs, our)
        if mode != "align":
            assert fields(theirs) == fields(our) == (0, None)
            continue
        # 0.33 publishes the grid, we publish the model LCM (README: equivalent under the validity rule).
        assert our.num_prefill_checkpoint_blocks == theirs.num_prefill_checkpoint_blocks == 1
        assert theirs.prefill_checkpoint_alignment == tb.vllm_published_alignment(
            our.prefill_checkpoint_alignment, prefix_match_unit=prefix_match_unit, block_size=block_size)
        assert tb.plans_flashinfer_checkpoints(our.prefill_checkpoint_alignment) == \
            tb.plans_flashinfer_checkpoints(theirs.prefill_checkpoint_alignment)


@pytest.mark.parametrize("mode", MODES)
def test_one_gdn_layer_without_export_disables_every_layer(mode):
    gdn = vllm_module("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn")
    cfg = vllm_config(mode)
    layers = [gdn_layer(gdn, cfg, "g0", "flashinfer"), gdn_layer(gdn, cfg, "g1", "triton")]
    derived = derive([Ours(tb.flashinfer_gdn_alignment(gdn_prefill_backend="flashinfer", mamba_cache_mode=mode)),
                      Ours(tb.flashinfer_gdn_alignment(gdn_prefill_backend="triton", mamba_cache_mode=mode))], cfg)
    for layer, our in zip(layers, derived):
        assert tb.from_vllm_spec(layer.get_kv_cache_spec(cfg)) == our
        assert fields(our) == (0, None)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ["flashkda", "triton"])
@pytest.mark.parametrize("module_name", ["vllm.models.kimi_k3.nvidia.kda", "vllm.models.glm5next.common.kda"])
def test_kimi_and_glm_kda_on_nvidia(mode, backend, module_name):
    module = vllm_module(module_name)
    cls = getattr(module, "KimiK3DeltaAttention", None) or module.Glm5NextLinearAttention
    cfg = vllm_config(mode, block_size=1152)
    layer = vllm_layer(cls, cfg, "kda", GDN_STATE, mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                       kda_prefill_backend=backend)
    (our,) = derive([Ours(tb.flashkda_alignment(kda_prefill_backend=backend))], cfg)
    theirs = tb.from_vllm_spec(layer.get_kv_cache_spec(cfg))
    if mode == "align" or backend != "flashkda":
        assert theirs == our
    else:  # 0.33 sets the fields whatever the cache mode; we derive them in align mode only
        assert fields(theirs) == (1, 16) and fields(our) == (0, None)
        same_but_checkpoint_fields(theirs, our)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_spec", [0, 1])
@pytest.mark.parametrize("backend,safe_gate,enabled", [("fused", True, True), ("fused", False, True),
                                                       ("triton", True, True), ("fused", True, False)])
def test_kimi_kda_on_rocm(mode, num_spec, backend, safe_gate, enabled):
    module = vllm_module("vllm.models.kimi_k3.amd.kda")
    cfg = vllm_config(mode, num_speculative_tokens=num_spec)
    layer = vllm_layer(module.KimiK3DeltaAttention, cfg, "kda", GDN_STATE,
                       mamba_type=MambaAttentionBackendEnum.GDN_ATTN, kda_prefill_backend=backend,
                       use_safe_gate=safe_gate, use_prefill_checkpoint=enabled)
    (our,) = derive([Ours(tb.rocm_fused_kda_alignment(kda_prefill_backend=backend, use_safe_gate=safe_gate,
                                                      num_speculative_tokens=num_spec,
                                                      use_prefill_checkpoint=enabled))], cfg)
    theirs = tb.from_vllm_spec(layer.get_kv_cache_spec(cfg))
    same_but_checkpoint_fields(theirs, our)
    vllm_capable = backend == "fused" and safe_gate and enabled
    assert fields(theirs) == ((1, 64) if vllm_capable else (0, None))
    if mode == "align" and num_spec == 0:
        assert theirs == our
    else:  # we also require align mode and no drafts (README)
        assert fields(our) == (0, None)


SPECS = [
    StateSpec(block_size=1024, shapes=((3, 2048), (8, 128, 128)), dtypes=("bfloat16", "float32"),
              mamba_type="gdn_attn", mamba_cache_mode="align", num_prefill_checkpoint_blocks=1,
              prefill_checkpoint_alignment=64),
    StateSpec(block_size=1024, shapes=((3, 2048), (8, 128, 128)), dtypes=("bfloat16", "float32"),
              mamba_type="gdn_attn", mamba_cache_mode="align", num_speculative_blocks=2, page_size_padded=1 << 21),
    StateSpec(block_size=512, shapes=((1024, 3),), dtypes=("bfloat16",), mamba_type="short_conv",
              mamba_cache_mode="align", tp_replicated=True, num_prefill_checkpoint_blocks=1,
              prefill_checkpoint_alignment=64, page_size_padded=1 << 21),
    StateSpec(block_size=256, shapes=((3, 4096), (64, 64, 128)), dtypes=("float16", "float32"),
              mamba_type="mamba2", mamba_cache_mode="all", num_speculative_blocks=1),
    StateSpec(block_size=1024, shapes=((3, 2048), (8, 128, 128)), dtypes=("bfloat16", "float32"),
              mamba_type="gdn_attn", mamba_cache_mode="align", num_prefill_checkpoint_blocks=2,
              prefill_checkpoint_alignment=1, page_size_padded=1 << 21),
]


@pytest.mark.parametrize("index", range(len(SPECS)))
def test_to_vllm_spec_answers_like_ours(index):
    ours = SPECS[index]
    theirs = tb.to_vllm_spec(ours)
    assert type(theirs) is MambaSpec and tb.vllm_available()
    assert tb.from_vllm_spec(theirs) == ours
    assert theirs.page_size_bytes == ours.page_size_bytes
    assert theirs.real_page_size_bytes == ours.state_content_size_bytes
    for mode in MODES:
        cfg = vllm_config(mode)
        assert theirs.max_memory_usage_bytes(cfg) == ours.max_memory_usage_bytes(mamba_cache_mode=mode)
        for max_len in (1, 1000, 1025, 131072):
            assert theirs.max_num_blocks_per_req(cfg, max_len) == \
                ours.max_num_blocks_per_req(max_len, mamba_cache_mode=mode)
    collections = [{"same": ours}, {f"s{i}": s for i, s in enumerate(SPECS)}]
    collections += [{"other": s, "same": ours} for s in SPECS]
    for collection in collections:
        vllm_collection = {name: tb.to_vllm_spec(s) for name, s in collection.items()}
        assert theirs.is_uniform_with_collection(vllm_collection) == ours.is_uniform_with_collection(collection)
    with pytest.raises(ValueError, match="^mamba_type"):
        tb.to_vllm_spec(StateSpec(block_size=16, shapes=((2,),), dtypes=("float32",), mamba_type="kda"))
