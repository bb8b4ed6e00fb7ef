"""vLLM-side cache specs for recurrent layers: the `MambaBase` design with both checkpoint fields derived, not declared.

A layer says only which checkpoint offsets its prefill kernel can export (`get_prefill_checkpoint_alignment`, None by
default); `RecurrentLayer.get_kv_cache_spec` fills `num_prefill_checkpoint_blocks` and `prefill_checkpoint_alignment`
from every recurrent layer of the model through `jaxckpt.plan.spec.derive_spec`, so layers carry no overrides and the
two fields cannot disagree. The per-backend alignments below state the conditions under which each backend exports.

With vLLM importable, `to_vllm_spec` turns our `StateSpec` into a real `vllm.v1.kv_cache_interface.MambaSpec`;
without it the `StateSpec` itself is the answer. Importing this module needs neither torch, jax nor vLLM.
Deliberate differences from vLLM 0.33.0 are listed in README.md.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence

from jaxckpt.plan.conventions import check_non_negative
from jaxckpt.plan.rules import checkpoint_grid, model_checkpoint_alignment
from jaxckpt.plan.spec import CACHE_MODES, DTYPE_BYTES, StateSpec, derive_spec

MAMBA2_ALIGNMENT = 1
SPLIT_CHECKPOINT_ALIGNMENT = 1
FLA_KDA_ALIGNMENT = 64
FLASHINFER_GDN_ALIGNMENT = 64
SHORT_CONV_ALIGNMENT = 1
FLASHKDA_ALIGNMENT = 16
ROCM_FUSED_KDA_ALIGNMENT = 64
BRIDGE_ALIGNMENT = 1


def _check_mode(mamba_cache_mode: str) -> str:
    if mamba_cache_mode not in CACHE_MODES:
        raise ValueError(f"mamba_cache_mode: must be one of {CACHE_MODES}, got {mamba_cache_mode!r}")
    return mamba_cache_mode


def mamba2_alignment() -> int:
    """Mamba2 (SSD): the scan forces a chunk break at the checkpoint, so any token works (only align mode reads it)."""
    return MAMBA2_ALIGNMENT


def split_checkpoint_alignment() -> int:
    """GDN/KDA over FLA kernels that return only final states: the row is cut at the checkpoint, the tail rerun."""
    return SPLIT_CHECKPOINT_ALIGNMENT


def fla_kda_alignment() -> int:
    """FLA's chunk KDA with intermediate states: one state per 64-token chunk of the query."""
    return FLA_KDA_ALIGNMENT


def flashinfer_gdn_alignment(*, gdn_prefill_backend: str, mamba_cache_mode: str) -> int | None:
    """GDN prefill: FlashInfer's `checkpoint_every_n_tokens` is a multiple of its 64-token chunk, declared in align
    mode; vLLM's other GDN prefill backends (Triton/FLA, CuTe DSL, AITER FlyDSL, SYCL) cannot export."""
    capable = gdn_prefill_backend == "flashinfer" and _check_mode(mamba_cache_mode) == "align"
    return FLASHINFER_GDN_ALIGNMENT if capable else None


def short_conv_alignment(*, mamba_cache_mode: str) -> int | None:
    """A conv-only layer (vLLM's Qwen4-Exp PLE short conv): its state is a copy of raw inputs; align mode only."""
    return SHORT_CONV_ALIGNMENT if _check_mode(mamba_cache_mode) == "align" else None


def flashkda_alignment(*, kda_prefill_backend: str) -> int | None:
    """FlashKDA writes checkpoints at multiples of its 16-token chunk; other KDA prefill backends here cannot."""
    return FLASHKDA_ALIGNMENT if kda_prefill_backend == "flashkda" else None


def rocm_fused_kda_alignment(*, kda_prefill_backend: str, use_safe_gate: bool, num_speculative_tokens: int | None,
                             use_prefill_checkpoint: bool = True) -> int | None:
    """ROCm fused KDA chunk kernel: 64-token chunks, only with the fused backend and the safe gate.

    `num_speculative_tokens`: an int also requires no drafts (README, deviation 5); None is vLLM 0.33's own rule,
    which does not look at drafts (what the vLLM plugin declares).
    """
    capable = use_prefill_checkpoint and kda_prefill_backend == "fused" and use_safe_gate
    if num_speculative_tokens is not None:
        capable = capable and check_non_negative(num_speculative_tokens, name="num_speculative_tokens") == 0
    return ROCM_FUSED_KDA_ALIGNMENT if capable else None


def bridge_alignment() -> int:
    """jaxckpt's own kernels called through torch_bridge take a checkpoint at any token."""
    return BRIDGE_ALIGNMENT


def vllm_published_alignment(model_alignment: int | None, *, prefix_match_unit: int | None,
                             block_size: int) -> int:
    """The alignment vLLM 0.33 stores in the spec of FlashInfer GDN and PLE short-conv layers: the checkpoint grid."""
    return checkpoint_grid(model_alignment, prefix_match_unit=prefix_match_unit, block_size=block_size)


def plans_flashinfer_checkpoints(prefill_checkpoint_alignment: int | None) -> bool:
    """Whether the GDN metadata builder plans FlashInfer checkpoints: only on a multiple of its 64-token chunk."""
    return (prefill_checkpoint_alignment is not None
            and prefill_checkpoint_alignment % FLASHINFER_GDN_ALIGNMENT == 0)


def dtype_name(dtype) -> str:
    """A dtype as the name `StateSpec` uses ("float32"); accepts names, torch dtypes and numpy dtypes."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtypes: unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return name


class RecurrentLayer:
    """Spec side of a recurrent layer, mirroring vLLM's `MambaBase`.

    Subclasses give `get_state_shape()` and `get_state_dtype()` (torch dtypes or names), or override `state_spec`;
    a layer able to export a checkpoint from inside one prefill overrides `get_prefill_checkpoint_alignment`.
    `get_kv_cache_spec` is not meant to be overridden: the checkpoint fields come from the whole model.
    """

    mamba_type: str = "mamba2"
    tp_replicated: bool = False
    num_heads: int = 1

    def get_state_shape(self) -> Sequence[tuple[int, ...]]:
        raise NotImplementedError(f"{type(self).__name__} must define get_state_shape() or state_spec()")

    def get_state_dtype(self) -> Sequence:
        raise NotImplementedError(f"{type(self).__name__} must define get_state_dtype() or state_spec()")

    def get_prefill_checkpoint_alignment(self) -> int | None:
        """Token alignment of the checkpoint offsets this layer's prefill can export; None: it cannot."""
        return None

    def state_spec(self, *, block_size: int, mamba_cache_mode: str, num_speculative_blocks: int = 0,
                   page_size_padded: int | None = None) -> StateSpec:
        """The base spec, without checkpoint fields (what vLLM's `MambaBase.get_kv_cache_spec` builds)."""
        return StateSpec(block_size=block_size,
                         shapes=tuple(tuple(int(d) for d in shape) for shape in self.get_state_shape()),
                         dtypes=tuple(dtype_name(d) for d in self.get_state_dtype()),
                         page_size_padded=page_size_padded, mamba_type=self.mamba_type,
                         mamba_cache_mode=mamba_cache_mode, num_speculative_blocks=num_speculative_blocks,
                         num_heads=self.num_heads, tp_replicated=self.tp_replicated)

    def get_kv_cache_spec(self, model_layers: Mapping[str, RecurrentLayer] | Iterable[RecurrentLayer], *,
                          block_size: int, mamba_cache_mode: str, num_speculative_blocks: int = 0,
                          page_size_padded: int | None = None, max_checkpoints_per_row: int = 1) -> StateSpec:
        """This layer's spec, its checkpoint fields derived over every recurrent layer of the model (this one too)."""
        layers = _layer_list(model_layers)
        for position, layer in enumerate(layers):
            if layer is self:
                return derive_model_specs(layers, block_size=block_size, mamba_cache_mode=mamba_cache_mode,
                                          num_speculative_blocks=num_speculative_blocks,
                                          page_size_padded=page_size_padded,
                                          max_checkpoints_per_row=max_checkpoints_per_row)[position]
        raise ValueError("model_layers: must include the layer whose spec is asked for")


def _layer_list(layers) -> list[RecurrentLayer]:
    values = list(layers.values() if isinstance(layers, Mapping) else layers)
    for layer in values:
        if not isinstance(layer, RecurrentLayer):
            raise ValueError(f"layers: every layer must be a RecurrentLayer, got {type(layer).__name__}")
    return values


def _alignments(layers: list[RecurrentLayer]) -> list[int | None]:
    return [layer.get_prefill_checkpoint_alignment() for layer in layers]


def model_alignment(layers: Mapping[str, RecurrentLayer] | Iterable[RecurrentLayer]) -> int | None:
    """The model's checkpoint alignment: LCM of every layer's, None as soon as one layer cannot export."""
    return model_checkpoint_alignment(_alignments(_layer_list(layers)))


def derive_model_specs(layers: Mapping[str, RecurrentLayer] | Sequence[RecurrentLayer], *, block_size: int,
                       mamba_cache_mode: str, num_speculative_blocks: int = 0, page_size_padded: int | None = None,
                       max_checkpoints_per_row: int = 1) -> dict[str, StateSpec] | list[StateSpec]:
    """Every layer's spec (a dict for a name -> layer mapping, else a list), checkpoint fields all-or-nothing."""
    values = _layer_list(layers)
    alignments = _alignments(values)
    specs = [derive_spec(layer.state_spec(block_size=block_size, mamba_cache_mode=mamba_cache_mode,
                                          num_speculative_blocks=num_speculative_blocks,
                                          page_size_padded=page_size_padded),
                         alignments, max_checkpoints_per_row=max_checkpoints_per_row) for layer in values]
    return dict(zip(layers.keys(), specs)) if isinstance(layers, Mapping) else specs


@functools.cache
def _vllm_spec_types():
    try:
        import torch
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        from vllm.v1.kv_cache_interface import MambaSpec
    except ImportError:
        return None
    return torch, MambaSpec, MambaAttentionBackendEnum


def vllm_available() -> bool:
    """Whether vLLM's spec classes import here (checked once per process)."""
    return _vllm_spec_types() is not None


def to_vllm_spec(spec: StateSpec):
    """vLLM's `MambaSpec` for `spec` when vLLM is importable (dtype names -> torch dtypes, type name -> enum);
    otherwise `spec` itself."""
    if not isinstance(spec, StateSpec):
        raise ValueError(f"spec: expected a StateSpec, got {type(spec).__name__}")
    types = _vllm_spec_types()
    if types is None:
        return spec
    torch, mamba_spec, backend_enum = types
    try:
        mamba_type = backend_enum[spec.mamba_type.upper()]
    except (KeyError, ValueError):  # vLLM's enum metaclass raises ValueError for unknown names
        raise ValueError(f"mamba_type: {spec.mamba_type!r} is not a vLLM Mamba backend "
                         f"({sorted(m.lower() for m in backend_enum.__members__)})") from None
    return mamba_spec(block_size=spec.block_size, shapes=spec.shapes,
                      dtypes=tuple(getattr(torch, name) for name in spec.dtypes),
                      page_size_padded=spec.page_size_padded, mamba_type=mamba_type,
                      mamba_cache_mode=spec.mamba_cache_mode, num_speculative_blocks=spec.num_speculative_blocks,
                      num_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks,
                      prefill_checkpoint_alignment=spec.prefill_checkpoint_alignment, num_heads=spec.num_heads,
                      tokens_per_state=spec.tokens_per_state, tp_replicated=spec.tp_replicated)


def from_vllm_spec(vllm_spec) -> StateSpec:
    """Our `StateSpec` for a vLLM `MambaSpec` (or any object with its fields); refuses disagreeing checkpoint fields."""
    mamba_type = vllm_spec.mamba_type
    return StateSpec(block_size=vllm_spec.block_size, shapes=tuple(tuple(s) for s in vllm_spec.shapes),
                     dtypes=tuple(dtype_name(d) for d in vllm_spec.dtypes),
                     page_size_padded=vllm_spec.page_size_padded,
                     mamba_type=mamba_type if isinstance(mamba_type, str) else mamba_type.name.lower(),
                     mamba_cache_mode=vllm_spec.mamba_cache_mode,
                     num_speculative_blocks=vllm_spec.num_speculative_blocks,
                     num_prefill_checkpoint_blocks=vllm_spec.num_prefill_checkpoint_blocks,
                     prefill_checkpoint_alignment=vllm_spec.prefill_checkpoint_alignment,
                     num_heads=vllm_spec.num_heads, tokens_per_state=vllm_spec.tokens_per_state,
                     tp_replicated=vllm_spec.tp_replicated)
