"""Recurrent-state cache specs: a mirror of vLLM 0.33.0's `MambaSpec`, the checkpoint-field derivation, block sizes.

The derivation is the design this project implements (vLLM's seed 000): a layer declares
`get_prefill_checkpoint_alignment()` (None by default); the spec carries `num_prefill_checkpoint_blocks` and
`prefill_checkpoint_alignment` only when every recurrent layer of the model declares one, so the two fields can never
disagree and a layer that cannot export never loses its boundary state to a skipped split.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from jaxckpt.plan.conventions import (check_choice, check_flag, check_int, check_non_negative, check_optional_positive,
                                      check_positive)
from jaxckpt.plan.rules import model_checkpoint_alignment

CACHE_MODES = ("none", "align", "all")
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int8": 1, "uint8": 1}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _shapes(shapes) -> tuple[tuple[int, ...], ...]:
    try:
        return tuple(tuple(check_non_negative(d, name="shapes") for d in shape) for shape in shapes)
    except TypeError:
        raise ValueError(f"shapes: must be a tuple of shapes (tuples of ints), got {shapes!r}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateSpec:
    """Per-layer recurrent-state cache spec, field for field vLLM's `MambaSpec` (dtypes as names, e.g. "float32").

    `num_prefill_checkpoint_blocks` counts the extra resident blocks for internal checkpoints: 1 in vLLM's mode, up to
    `max_checkpoints_per_row` in the extended mode (vLLM 0.33's cache manager consumes only one).
    """

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None
    num_heads: int = 1
    tokens_per_state: int = -1
    tp_replicated: bool = False

    def __post_init__(self):
        def _set(name, value):
            # frozen: the checked value (Python ints, tuples) replaces the given one
            object.__setattr__(self, name, value)

        _set("shapes", _shapes(self.shapes))
        try:
            dtypes = tuple(self.dtypes)
        except TypeError:
            raise ValueError(f"dtypes: must be a tuple of dtype names, got {self.dtypes!r}") from None
        if len(self.shapes) != len(dtypes):
            raise ValueError(f"dtypes: {len(dtypes)} entries for {len(self.shapes)} shapes")
        for dtype in dtypes:
            if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
                raise ValueError(f"dtypes: unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
        _set("dtypes", dtypes)
        if not isinstance(self.mamba_type, str):
            raise ValueError(f"mamba_type: must be a str, got {self.mamba_type!r}")
        check_choice(self.mamba_cache_mode, CACHE_MODES, name="mamba_cache_mode")
        checks = dict(block_size=check_positive, page_size_padded=check_optional_positive,
                      num_speculative_blocks=check_non_negative, num_prefill_checkpoint_blocks=check_non_negative,
                      prefill_checkpoint_alignment=check_optional_positive, num_heads=check_positive,
                      tokens_per_state=check_int, tp_replicated=check_flag)
        for name, check in checks.items():
            _set(name, check(getattr(self, name), name=name))
        if (self.num_prefill_checkpoint_blocks > 0) != (self.prefill_checkpoint_alignment is not None):
            raise ValueError("num_prefill_checkpoint_blocks and prefill_checkpoint_alignment: must be set together "
                             f"(got {self.num_prefill_checkpoint_blocks} and {self.prefill_checkpoint_alignment})")
        if self.page_size_padded is not None and self.page_size_padded < self.state_content_size_bytes:
            raise ValueError(f"page_size_padded: {self.page_size_padded} is below the state size "
                             f"{self.state_content_size_bytes}")

    @property
    def state_content_size_bytes(self) -> int:
        return sum(math.prod(shape) * DTYPE_BYTES[dtype] for shape, dtype in zip(self.shapes, self.dtypes))

    @property
    def page_size_bytes(self) -> int:
        return self.state_content_size_bytes if self.page_size_padded is None else self.page_size_padded

    def max_memory_usage_bytes(self, *, mamba_cache_mode: str | None = None) -> int:
        """Per-request pool memory: align keeps the previous and running blocks, scratch and checkpoint blocks."""
        mode = self.mamba_cache_mode if mamba_cache_mode is None else mamba_cache_mode
        check_choice(mode, CACHE_MODES, name="mamba_cache_mode")
        if mode == "align":
            return self.page_size_bytes * (2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks)
        return self.page_size_bytes * (1 + self.num_speculative_blocks)

    def max_num_blocks_per_req(self, max_len: int, *, mamba_cache_mode: str | None = None) -> int:
        """Block-table row length: align rows are position-indexed over the whole sequence."""
        max_len = check_non_negative(max_len, name="max_len")
        mode = self.mamba_cache_mode if mamba_cache_mode is None else mamba_cache_mode
        check_choice(mode, CACHE_MODES, name="mamba_cache_mode")
        if mode == "align":
            return _cdiv(max_len, self.block_size) + self.num_speculative_blocks
        return _cdiv(self.max_memory_usage_bytes(mamba_cache_mode=mode), self.page_size_bytes)

    def is_uniform_with_collection(self, specs: Mapping[str, StateSpec] | Iterable[StateSpec]) -> bool:
        """Whether specs can share one KV-cache group (vLLM's grouping rule)."""
        values = specs.values() if isinstance(specs, Mapping) else specs
        return all(
            isinstance(spec, StateSpec)
            and spec.num_speculative_blocks == self.num_speculative_blocks
            and spec.num_prefill_checkpoint_blocks == self.num_prefill_checkpoint_blocks
            and spec.prefill_checkpoint_alignment == self.prefill_checkpoint_alignment
            and spec.page_size_bytes == self.page_size_bytes
            and spec.tp_replicated == self.tp_replicated
            for spec in values)


def derive_checkpoint_fields(layer_alignments: Iterable[int | None], *, mamba_cache_mode: str,
                             max_checkpoints_per_row: int = 1) -> tuple[int, int | None]:
    """(num_prefill_checkpoint_blocks, prefill_checkpoint_alignment) for every recurrent layer of a model.

    All-or-nothing: one layer that cannot export disables checkpoints for all, because the scheduler would otherwise
    stop splitting prefill and that layer would lose its boundary state. Only align mode uses them.
    """
    check_choice(mamba_cache_mode, CACHE_MODES, name="mamba_cache_mode")
    max_checkpoints_per_row = check_positive(max_checkpoints_per_row, name="max_checkpoints_per_row")
    alignment = model_checkpoint_alignment(layer_alignments)
    if mamba_cache_mode != "align" or alignment is None:
        return 0, None
    return max_checkpoints_per_row, alignment


def derive_spec(spec: StateSpec, layer_alignments: Iterable[int | None], *,
                max_checkpoints_per_row: int = 1) -> StateSpec:
    """The spec with both checkpoint fields filled from the model's layers (see `derive_checkpoint_fields`)."""
    if not isinstance(spec, StateSpec):
        raise ValueError(f"spec: must be a StateSpec, got {type(spec).__name__}")
    blocks, alignment = derive_checkpoint_fields(layer_alignments, mamba_cache_mode=spec.mamba_cache_mode,
                                                 max_checkpoints_per_row=max_checkpoints_per_row)
    return dataclasses.replace(spec, num_prefill_checkpoint_blocks=blocks, prefill_checkpoint_alignment=alignment)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_size: int                 # attention (and, in align mode, recurrent) block size in tokens
    mamba_block_size: int | None    # set in align mode (= block_size), else left to the caller
    mamba_page_size_padded: int | None  # recurrent page padded to the attention page, None when equal


def hybrid_block_sizes(*, mamba_page_bytes: int, attention_page_bytes_per_token: int, cache_block_size: int,
                       min_kernel_block_size: int, backend_block_alignment: int = 1, use_mla: bool = False,
                       mamba_cache_mode: str = "align", checkpoint_alignment: int | None = None) -> BlockSizes:
    """vLLM 0.33's hybrid block-size alignment (`Platform._align_hybrid_block_size`); "all" has no branch of its own.

    The kernel block alignment (the attention backend's smallest kernel block, at least the configured block size,
    128 under MLA) is lcm'd with the model's checkpoint alignment in align mode; the block is then the smallest
    multiple of it whose attention page holds one recurrent page, rounded up to every backend's smallest block.
    """
    check_choice(mamba_cache_mode, CACHE_MODES, name="mamba_cache_mode")
    mamba_page_bytes = check_positive(mamba_page_bytes, name="mamba_page_bytes")
    attention_page_bytes_per_token = check_positive(attention_page_bytes_per_token,
                                                    name="attention_page_bytes_per_token")
    cache_block_size = check_positive(cache_block_size, name="cache_block_size")
    min_kernel_block_size = check_positive(min_kernel_block_size, name="min_kernel_block_size")
    backend_block_alignment = check_positive(backend_block_alignment, name="backend_block_alignment")
    use_mla = check_flag(use_mla, name="use_mla")
    checkpoint_alignment = check_optional_positive(checkpoint_alignment, name="checkpoint_alignment")
    kernel_alignment = max(min_kernel_block_size, cache_block_size)
    if use_mla:
        kernel_alignment = max(kernel_alignment, 128)
    if mamba_cache_mode == "align":
        kernel_alignment = math.lcm(kernel_alignment, checkpoint_alignment or 1)
    attn_block = kernel_alignment * _cdiv(mamba_page_bytes, kernel_alignment * attention_page_bytes_per_token)
    attn_block = backend_block_alignment * _cdiv(attn_block, backend_block_alignment)
    block_size = max(cache_block_size, attn_block)
    attn_page = block_size * attention_page_bytes_per_token
    padded = None if attn_page == mamba_page_bytes else attn_page
    return BlockSizes(block_size, block_size if mamba_cache_mode == "align" else None, padded)
