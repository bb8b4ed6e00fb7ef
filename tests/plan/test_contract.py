"""The input contract of every public `jaxckpt.plan` entry: a catalogue of invalid calls, each a ValueError whose
message starts with the argument's name; numpy integer scalars answer as Python ints; fuzzed valid inputs never
raise and a corruption of one argument names that argument."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxckpt.plan import (batch_checkpoints, bucket_size, checkpoint_column, checkpoint_grid, checkpoint_position,
                          checkpoint_rows, checkpoints_from_rows, checkpoints_to_rows, chunk_layout,
                          initial_state_column, is_checkpoint_valid, map_vllm_slots, max_chunks,
                          model_checkpoint_alignment, pad_checkpoints, prefill_checkpoints, row_checkpoints,
                          split_layout, validate_checkpoints, validate_cu_seqlens, validate_slots)
from jaxckpt.plan.checks import check_dt_limit, delta_dims
from jaxckpt.plan.conventions import check_state_layout
from jaxckpt.plan.scheduler import SchedulerConfig, block_aligned_split
from jaxckpt.plan.spec import StateSpec, derive_checkpoint_fields, derive_spec, hybrid_block_sizes

CU = np.array([0, 10, 10, 30])
CCU = np.array([0, 2, 2, 3])
OFFS = np.array([1, 9, 19, 0])
RULE = dict(hash_block_size=16, block_size=16, alignment=1)
SPEC = dict(block_size=16, shapes=((4, 8),), dtypes=("float32",))
SIZES = dict(mamba_page_bytes=4096, attention_page_bytes_per_token=64, cache_block_size=16, min_kernel_block_size=16)


def u8(value):
    return np.uint8(value)


INVALID = [
    # conventions
    ("cu_seqlens", lambda: validate_cu_seqlens([0, 3, 2], 8)),
    ("cu_seqlens", lambda: validate_cu_seqlens([0.0, 3.0], 8)),
    ("cu_seqlens", lambda: validate_cu_seqlens(np.array([False, True]), 8)),
    ("cu_seqlens", lambda: validate_cu_seqlens([[0, 3]], 8)),
    ("cu_seqlens", lambda: validate_cu_seqlens([0, None], 8)),
    ("cu_seqlens", lambda: validate_cu_seqlens(np.array([0, 2**63], np.uint64), 2**62)),
    ("num_tokens", lambda: validate_cu_seqlens([0, 3], 8.0)),
    ("num_tokens", lambda: validate_cu_seqlens([0, 3], True)),
    ("checkpoint_cu", lambda: validate_checkpoints([0, 1, 1], [5], CU)),
    ("checkpoint_cu", lambda: validate_checkpoints([0, 1, 1, 1, 1], [5], CU)),
    ("checkpoint_cu", lambda: validate_checkpoints([0, 2, 1, 2], [5, 6], CU)),
    ("checkpoint_cu", lambda: validate_checkpoints(np.array([0, 1, 1, 1], float), [5], CU)),
    ("checkpoint_cu", lambda: validate_checkpoints(np.array([0, 1, 1, 1], bool), [5], CU)),
    ("checkpoint_cu and checkpoint_offsets", lambda: validate_checkpoints([0, 1], None, CU)),
    ("checkpoint_offsets", lambda: validate_checkpoints([0, 2, 2, 2], [6, 5], CU)),
    ("checkpoint_offsets", lambda: validate_checkpoints([0, 1, 1, 1], [10], CU)),
    ("checkpoint_offsets", lambda: validate_checkpoints([0, 1, 1, 1], [5.0], CU)),
    ("checkpoint_offsets", lambda: validate_checkpoints([0, 1, 1, 1], np.array([True]), CU)),
    ("checkpoint_offsets", lambda: validate_checkpoints([0, 1, 1, 1], [5, 2], CU)),
    ("cu_seqlens", lambda: validate_checkpoints([0, 1], [5], [0, 10, 5])),
    ("num_checkpoints", lambda: checkpoint_rows(CCU, 2)),
    ("num_checkpoints", lambda: checkpoint_rows(CCU, 4.0)),
    ("checkpoint_cu", lambda: checkpoint_rows([1, 2], 4)),
    ("checkpoint_cu", lambda: checkpoint_rows([0, 2, 1], 4)),
    ("size", lambda: pad_checkpoints(CCU, OFFS, 2)),
    ("size", lambda: pad_checkpoints(CCU, OFFS, 8.0)),
    ("checkpoint_cu", lambda: pad_checkpoints(CCU, OFFS[:2], 4)),
    ("checkpoint_state_indices", lambda: pad_checkpoints(CCU, OFFS, 4, checkpoint_state_indices=[1, 2])),
    ("checkpoint_state_indices", lambda: pad_checkpoints(CCU, OFFS, 4, checkpoint_state_indices=[1.0, 2.0, 3.0])),
    ("offsets", lambda: checkpoints_from_rows([5, -1])),
    ("offsets", lambda: checkpoints_from_rows([5.5, 0])),
    ("offsets", lambda: checkpoints_from_rows(np.zeros((2, 2, 2), int))),
    ("columns", lambda: checkpoints_from_rows([5, 0], [0])),
    ("columns", lambda: checkpoints_from_rows([5, 0], [-1, -1])),
    ("columns", lambda: checkpoints_from_rows([5, 0], [0, -2])),
    ("max_per_row", lambda: checkpoints_to_rows(CCU, OFFS, max_per_row=1)),
    ("max_per_row", lambda: checkpoints_to_rows(CCU, OFFS, max_per_row=0)),
    ("max_per_row", lambda: checkpoints_to_rows(CCU, OFFS, max_per_row=True)),
    ("checkpoint_columns", lambda: checkpoints_to_rows(CCU, OFFS, [1], max_per_row=2)),
    ("checkpoint_cu", lambda: checkpoints_to_rows([0, 3], [1, 2], max_per_row=4)),
    ("final_state_indices", lambda: validate_slots([4], 4, name="final_state_indices")),
    ("final_state_indices", lambda: validate_slots(np.array([True]), 4, name="final_state_indices")),
    ("num_slots", lambda: validate_slots([1], 4.0, name="final_state_indices")),
    ("allow_null", lambda: validate_slots([1], 4, name="final_state_indices", allow_null=1)),
    ("indices", lambda: map_vllm_slots([-2])),
    ("indices", lambda: map_vllm_slots([1.5])),
    ("indices", lambda: map_vllm_slots([[1, 2]])),
    ("state_layout", lambda: check_state_layout("kvv")),
    ("state_layout", lambda: check_state_layout(["kv"])),
    # checks
    ("dt_limit", lambda: check_dt_limit((0.0,))),
    ("dt_limit", lambda: check_dt_limit(("0", "1"))),
    ("dt_limit", lambda: check_dt_limit((False, True))),
    ("dt_limit", lambda: check_dt_limit((2.0, 1.0))),
    ("per_channel_decay", lambda: delta_dims(*(np.zeros((2, 1, 4)),) * 3, np.zeros((2, 1)), np.zeros((2, 1)),
                                             per_channel_decay=None)),
    # rules: the fuzz findings first (block_size unchecked when alignment is None)
    *[("block_size", lambda b=b, policy=policy: row_checkpoints(0, 100, hash_block_size=16, block_size=b,
                                                                alignment=None, policy=policy,
                                                                positions=[50] if policy == "positions" else ()))
      for b in (0, 16.5, None, True) for policy in ("every_block", "positions", "vllm")],
    *[("block_size", lambda b=b: is_checkpoint_valid(0, 100, 64, hash_block_size=16, block_size=b, alignment=None))
      for b in (0, 16.5, None, True)],
    *[("block_size", lambda b=b: prefill_checkpoints([0], [100], hash_block_size=16, block_size=b, alignment=None))
      for b in (0, 16.5, None, True)],
    ("block_size", lambda: batch_checkpoints([], [], hash_block_size=16, block_size=0, alignment=None)),
    ("hash_block_size", lambda: is_checkpoint_valid(0, 100, 64, hash_block_size=None, block_size=16,
                                                    alignment=None)),
    ("alignment", lambda: is_checkpoint_valid(0, 100, 64, hash_block_size=16, block_size=16, alignment=0)),
    ("alignment", lambda: is_checkpoint_valid(0, 100, 64, hash_block_size=16, block_size=16, alignment=1.0)),
    ("query_start", lambda: is_checkpoint_valid(-1, 100, 64, **RULE)),
    ("query_end", lambda: is_checkpoint_valid(50, 40, 64, **RULE)),
    ("position", lambda: is_checkpoint_valid(0, 100, 64.0, **RULE)),
    ("num_tokens", lambda: checkpoint_position(-1, 16)),
    ("num_tokens", lambda: checkpoint_position(10.0, 16)),
    ("hash_block_size", lambda: checkpoint_position(10, 0)),
    ("hash_block_size", lambda: checkpoint_position(10, True)),
    ("drop_eagle_block", lambda: checkpoint_position(10, 4, drop_eagle_block=1)),
    ("num_hash_lookahead_tokens", lambda: checkpoint_position(10, 4, num_hash_lookahead_tokens=-1)),
    ("query_end", lambda: checkpoint_column(-1, 16)),
    ("block_size", lambda: checkpoint_column(10, 0)),
    ("query_start", lambda: initial_state_column(1.5, 16)),
    ("block_size", lambda: initial_state_column(10, None)),
    ("layer_alignments", lambda: model_checkpoint_alignment([0])),
    ("layer_alignments", lambda: model_checkpoint_alignment([None, 0])),
    ("layer_alignments", lambda: model_checkpoint_alignment([16, True])),
    ("layer_alignments", lambda: model_checkpoint_alignment(16)),
    ("alignment", lambda: checkpoint_grid(None, prefix_match_unit=24, block_size=16)),
    ("alignment", lambda: checkpoint_grid(0, prefix_match_unit=24, block_size=16)),
    ("prefix_match_unit", lambda: checkpoint_grid(16, prefix_match_unit=0, block_size=16)),
    ("block_size", lambda: checkpoint_grid(16, prefix_match_unit=None, block_size=None)),
    ("block_size", lambda: checkpoint_grid(16, prefix_match_unit=24, block_size=0)),
    ("query_starts", lambda: prefill_checkpoints([-1], [3], **RULE)),
    ("query_starts", lambda: prefill_checkpoints([[0]], [[3]], **RULE)),
    ("query_starts", lambda: prefill_checkpoints([0.0], [3], **RULE)),
    ("query_ends", lambda: prefill_checkpoints([5], [3], **RULE)),
    ("query_ends", lambda: prefill_checkpoints([0, 0], [3], **RULE)),
    ("query_ends", lambda: prefill_checkpoints([0], np.array([True]), **RULE)),
    ("cache_hit_alignment_tokens", lambda: prefill_checkpoints([0], [3], **RULE, cache_hit_alignment_tokens=0)),
    ("drop_eagle_block", lambda: prefill_checkpoints([0], [3], **RULE, drop_eagle_block="no")),
    ("policy", lambda: row_checkpoints(0, 10, **RULE, policy="all")),
    ("max_checkpoints_per_row", lambda: row_checkpoints(0, 10, **RULE, max_checkpoints_per_row=0)),
    ("positions", lambda: row_checkpoints(0, 100, **RULE, policy="positions", positions=[50.5])),
    ("positions", lambda: row_checkpoints(0, 100, **RULE, policy="positions", positions=[-16])),
    ("positions", lambda: row_checkpoints(0, 100, **RULE, policy="every_block", positions=[50])),
    ("query_end", lambda: row_checkpoints(10, 5, **RULE)),
    ("positions", lambda: batch_checkpoints([0], [100], **RULE, policy="positions", positions=[[50], [60]])),
    ("positions", lambda: batch_checkpoints([0], [100], **RULE, policy="positions", positions=5)),
    ("query_ends", lambda: batch_checkpoints([0, 1], [100], **RULE)),
    ("policy", lambda: batch_checkpoints([], [], **RULE, policy=None)),
    # layout: the fuzz findings (wrong-length checkpoint_cu, unsorted offsets)
    ("checkpoint_cu", lambda: split_layout(CU, [0, 1, 1], [5])),
    ("checkpoint_cu", lambda: split_layout(CU, [0, 1, 1, 1, 1], [5])),
    ("checkpoint_offsets", lambda: split_layout(CU, [0, 2, 2, 2], [6, 3])),
    ("checkpoint_offsets", lambda: split_layout(CU, [0, 2, 2, 2], [3, 3])),
    ("cu_seqlens", lambda: split_layout([0, 5, 3], [0, 0, 0], [])),
    ("cu_seqlens", lambda: chunk_layout([0, 5, 3], [0, 0, 0], [], chunk_size=4, num_tokens=8)),
    ("cu_seqlens", lambda: chunk_layout([0, 9], [0, 0], [], chunk_size=4, num_tokens=8)),
    ("checkpoint_cu", lambda: chunk_layout(CU, [0, 1, 1], [5], chunk_size=4, num_tokens=30)),
    ("checkpoint_offsets", lambda: chunk_layout(CU, [0, 2, 2, 2], [6, 3], chunk_size=4, num_tokens=30)),
    ("chunk_size", lambda: chunk_layout(CU, CCU, OFFS, chunk_size=0, num_tokens=30)),
    ("chunk_size", lambda: chunk_layout(CU, CCU, OFFS, chunk_size=4.0, num_tokens=30)),
    ("num_tokens", lambda: chunk_layout(CU, CCU, OFFS, chunk_size=4, num_tokens=None)),
    ("forced_breaks", lambda: chunk_layout(CU, CCU, OFFS, chunk_size=4, num_tokens=30, forced_breaks=0)),
    ("chunk_size", lambda: max_chunks(30, 3, 3, 0, forced_breaks=False)),
    ("num_rows", lambda: max_chunks(30, -1, 3, 4, forced_breaks=False)),
    ("forced_breaks", lambda: max_chunks(30, 3, 3, 4, forced_breaks=None)),
    ("n", lambda: bucket_size(-1)),
    ("n", lambda: bucket_size(16.5)),
    ("minimum", lambda: bucket_size(3, minimum=-1)),
    # scheduler
    ("block_size", lambda: SchedulerConfig(block_size=16.0)),
    ("hash_block_size", lambda: SchedulerConfig(block_size=768, hash_block_size=500)),
    ("scheduler_block_size", lambda: SchedulerConfig(block_size=16, scheduler_block_size=0)),
    ("checkpoint_alignment", lambda: SchedulerConfig(block_size=16, has_checkpoint_blocks=True)),
    ("checkpoint_alignment", lambda: SchedulerConfig(block_size=16, has_checkpoint_blocks=True,
                                                     checkpoint_alignment=0)),
    ("has_checkpoint_blocks", lambda: SchedulerConfig(block_size=16, has_checkpoint_blocks=1,
                                                      checkpoint_alignment=16)),
    ("partial_cache_hit", lambda: SchedulerConfig(block_size=16, partial_cache_hit="yes")),
    ("eagle_block_drop", lambda: SchedulerConfig(block_size=16, eagle_block_drop=True, num_hash_lookahead_tokens=2)),
    ("max_num_scheduled_tokens", lambda: SchedulerConfig(block_size=16, max_num_scheduled_tokens=0)),
    ("long_prefill_token_threshold", lambda: SchedulerConfig(block_size=16, long_prefill_token_threshold=-1)),
    ("shared_prefix_checkpoint", lambda: SchedulerConfig(block_size=16, shared_prefix_checkpoint=None)),
    ("config", lambda: block_aligned_split(None, num_prompt_tokens=10, num_tokens=10, num_computed_tokens=0,
                                           num_new_tokens=10)),
    ("num_new_tokens", lambda: block_aligned_split(SchedulerConfig(block_size=16), num_prompt_tokens=10,
                                                   num_tokens=10, num_computed_tokens=0, num_new_tokens=-1)),
    ("shared_prefix_boundary", lambda: block_aligned_split(SchedulerConfig(block_size=16), num_prompt_tokens=10,
                                                           num_tokens=10, num_computed_tokens=0, num_new_tokens=10,
                                                           shared_prefix_boundary=1.5)),
    # spec
    ("block_size", lambda: StateSpec(**{**SPEC, "block_size": 0})),
    ("block_size", lambda: StateSpec(**{**SPEC, "block_size": None})),
    ("shapes", lambda: StateSpec(**{**SPEC, "shapes": ((4, 8.0),)})),
    ("shapes", lambda: StateSpec(**{**SPEC, "shapes": (4,)})),
    ("dtypes", lambda: StateSpec(**{**SPEC, "dtypes": ("float33",)})),
    ("dtypes", lambda: StateSpec(**{**SPEC, "dtypes": (["float32"],)})),
    ("dtypes", lambda: StateSpec(**{**SPEC, "dtypes": ()})),
    ("mamba_type", lambda: StateSpec(**SPEC, mamba_type=2)),
    ("mamba_cache_mode", lambda: StateSpec(**SPEC, mamba_cache_mode="some")),
    ("page_size_padded", lambda: StateSpec(**SPEC, page_size_padded=0)),
    ("page_size_padded", lambda: StateSpec(**SPEC, page_size_padded=64)),
    ("num_speculative_blocks", lambda: StateSpec(**SPEC, num_speculative_blocks=-1)),
    ("prefill_checkpoint_alignment", lambda: StateSpec(**SPEC, num_prefill_checkpoint_blocks=1,
                                                       prefill_checkpoint_alignment=0)),
    ("num_prefill_checkpoint_blocks and prefill_checkpoint_alignment",
     lambda: StateSpec(**SPEC, num_prefill_checkpoint_blocks=1)),
    ("num_heads", lambda: StateSpec(**SPEC, num_heads=0)),
    ("tokens_per_state", lambda: StateSpec(**SPEC, tokens_per_state=None)),
    ("tp_replicated", lambda: StateSpec(**SPEC, tp_replicated=0)),
    ("mamba_cache_mode", lambda: StateSpec(**SPEC).max_memory_usage_bytes(mamba_cache_mode="some")),
    ("max_len", lambda: StateSpec(**SPEC).max_num_blocks_per_req(-1)),
    ("mamba_cache_mode", lambda: derive_checkpoint_fields([16], mamba_cache_mode="aligned")),
    ("max_checkpoints_per_row", lambda: derive_checkpoint_fields([16], mamba_cache_mode="align",
                                                                 max_checkpoints_per_row=0)),
    ("layer_alignments", lambda: derive_checkpoint_fields([16, 0], mamba_cache_mode="align")),
    ("spec", lambda: derive_spec(SPEC, [16])),
    ("mamba_cache_mode", lambda: hybrid_block_sizes(**SIZES, mamba_cache_mode="some")),
    ("mamba_page_bytes", lambda: hybrid_block_sizes(**{**SIZES, "mamba_page_bytes": 0})),
    ("cache_block_size", lambda: hybrid_block_sizes(**{**SIZES, "cache_block_size": 16.0})),
    ("min_kernel_block_size", lambda: hybrid_block_sizes(**{**SIZES, "min_kernel_block_size": None})),
    ("backend_block_alignment", lambda: hybrid_block_sizes(**SIZES, backend_block_alignment=0)),
    ("use_mla", lambda: hybrid_block_sizes(**SIZES, use_mla=1)),
    ("checkpoint_alignment", lambda: hybrid_block_sizes(**SIZES, checkpoint_alignment=0)),
]


@pytest.mark.parametrize("name, call", INVALID, ids=[f"{i}-{name}" for i, (name, _) in enumerate(INVALID)])
def test_invalid_call_names_the_argument(name, call):
    with pytest.raises(ValueError, match=f"^{name}:"):
        call()


def test_bools_and_non_integers_get_their_own_message():
    with pytest.raises(ValueError, match="^block_size: must be an integer, got the bool True"):
        checkpoint_column(10, True)
    with pytest.raises(ValueError, match="^cu_seqlens: .*bool array"):
        validate_cu_seqlens(np.array([False, True]), 4)
    with pytest.raises(ValueError, match="^cu_seqlens: must hold integers, got dtype float64"):
        validate_cu_seqlens([0.0, 4.0], 4)


def test_numpy_uint8_sizes_answer_as_python_ints():
    # each of these wrapped around in uint8 arithmetic before the sizes were converted
    assert checkpoint_position(u8(0), u8(16)) == checkpoint_position(0, 16) == 0
    # query_start + hash_block_size = 300 > position: invalid, 44 in uint8
    assert not is_checkpoint_valid(u8(200), u8(255), u8(250), hash_block_size=u8(100), block_size=u8(50),
                                   alignment=u8(1))
    assert (hybrid_block_sizes(mamba_page_bytes=u8(250), attention_page_bytes_per_token=u8(2),
                               cache_block_size=u8(200), min_kernel_block_size=u8(200))
            == hybrid_block_sizes(mamba_page_bytes=250, attention_page_bytes_per_token=2, cache_block_size=200,
                                  min_kernel_block_size=200))
    spec = StateSpec(block_size=u8(200), shapes=((u8(200), u8(200)),), dtypes=("float32",),
                     num_speculative_blocks=u8(3), mamba_cache_mode="align")
    assert spec.state_content_size_bytes == 200 * 200 * 4
    assert spec.max_num_blocks_per_req(u8(250)) == 2 + 3
    config = SchedulerConfig(block_size=u8(200), max_num_scheduled_tokens=u8(250))
    assert type(config.block_size) is int
    assert (block_aligned_split(config, num_prompt_tokens=u8(250), num_tokens=u8(250), num_computed_tokens=u8(10),
                                num_new_tokens=u8(240))
            == block_aligned_split(SchedulerConfig(block_size=200, max_num_scheduled_tokens=250),
                                   num_prompt_tokens=250, num_tokens=250, num_computed_tokens=10,
                                   num_new_tokens=240))
    assert bucket_size(u8(200), minimum=u8(16)) == 256
    assert max_chunks(u8(255), u8(200), u8(200), u8(1), forced_breaks=True) == 655


def test_traced_chunk_layout_checks_shapes_and_dtypes_only():
    import jax
    import jax.numpy as jnp

    def run(cu, ccu, offsets):
        return jax.jit(lambda a, b, c: chunk_layout(a, b, c, chunk_size=4, num_tokens=30, xp=jnp))(cu, ccu, offsets)

    run(CU, CCU, OFFS)
    # values are the caller's: unsorted offsets pass while traced
    run(CU, np.array([0, 2, 2, 2]), np.array([6, 3]))
    with pytest.raises(ValueError, match="^checkpoint_cu:"):
        run(CU, np.array([0, 1, 1]), np.array([5]))
    with pytest.raises(ValueError, match="^checkpoint_offsets:"):
        run(CU, CCU, OFFS.astype(np.float32))
    with pytest.raises(ValueError, match="^cu_seqlens:"):
        run(CU.astype(bool), CCU, OFFS)


@st.composite
def batches(draw):
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = [sorted(draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=3))) if n > 1 else [] for n in lengths]
    ccu = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    padding = draw(st.integers(0, 3))
    offsets = np.array([o for r in rows for o in r] + [0] * padding, np.int64)
    num_tokens = int(cu[-1]) + draw(st.integers(0, 5))
    dtype = draw(st.sampled_from([np.int32, np.int64, np.uint16]))
    return cu.astype(dtype), ccu.astype(dtype), offsets.astype(dtype), num_tokens, lengths


def _corruptions(cu, ccu, offsets, lengths):
    real = int(ccu[-1])
    out = {
        "cu_seqlens": [cu.astype(np.float64), cu.astype(bool), cu[None], cu[:1], cu + 1,
                       np.concatenate([cu[:-1], [int(cu[-2]) - 1]])],
        "checkpoint_cu": [ccu[:-1], np.concatenate([ccu, ccu[-1:]]), ccu.astype(np.float64), ccu + 1,
                          np.concatenate([ccu[:-1], [offsets.size + 1]])],
        "checkpoint_offsets": [offsets[None]],
    }
    if set(np.unique(ccu).tolist()) <= {0, 1}:
        out["checkpoint_cu"].append(ccu.astype(bool))
    if offsets.size:
        out["checkpoint_offsets"] += [offsets.astype(np.float64), offsets.astype(bool)]
    if real:
        row = int(np.searchsorted(ccu, 0, side="right")) - 1
        for value in (0, lengths[row]):
            bad = offsets.copy()
            bad[ccu[row]] = value
            out["checkpoint_offsets"].append(bad)
    for n in range(len(lengths)):
        if ccu[n + 1] - ccu[n] >= 2:
            bad = offsets.copy()
            bad[ccu[n]:ccu[n + 1]] = bad[ccu[n]:ccu[n + 1]][::-1]
            out["checkpoint_offsets"].append(bad)
    if offsets.size > real:
        bad = offsets.copy()
        bad[-1] = 1
        out["checkpoint_offsets"].append(bad)
    return out


def _metadata_calls(cu, ccu, offsets, num_tokens):
    return [
        lambda: validate_checkpoints(ccu, offsets, validate_cu_seqlens(cu, num_tokens)),
        lambda: split_layout(cu, ccu, offsets),
        lambda: chunk_layout(cu, ccu, offsets, chunk_size=8, num_tokens=num_tokens, forced_breaks=True),
    ]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.data())
def test_fuzzed_metadata_valid_never_raises_and_one_corruption_names_its_argument(batch, data):
    cu, ccu, offsets, num_tokens, lengths = batch
    for call in _metadata_calls(cu, ccu, offsets, num_tokens):
        call()
    real = int(ccu[-1])
    assert checkpoint_rows(ccu, offsets.size).tolist() == np.repeat(np.arange(len(lengths)), np.diff(ccu)).tolist() \
        + [-1] * (offsets.size - real)
    assert pad_checkpoints(ccu, offsets, offsets.size + 2).tolist() == offsets.tolist() + [0, 0]
    checkpoints_to_rows(ccu, offsets, max_per_row=max(int(np.diff(ccu).max()), 1))

    corruptions = _corruptions(cu, ccu, offsets, lengths)
    name = data.draw(st.sampled_from(sorted(corruptions)))
    bad = data.draw(st.sampled_from(corruptions[name]))
    args = dict(cu=cu, ccu=ccu, offsets=offsets)
    args[{"cu_seqlens": "cu", "checkpoint_cu": "ccu", "checkpoint_offsets": "offsets"}[name]] = bad
    call = data.draw(st.sampled_from(_metadata_calls(**args, num_tokens=max(num_tokens, int(np.max(cu))))))
    with pytest.raises(ValueError, match=f"^{name}:"):
        call()


# valid draws and bad values per argument kind; the functions take Python ints and numpy integer scalars alike
INT_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
BAD = {
    "positive": [0, -1, 16.5, None, True, "16", np.float64(16), np.bool_(True)],
    "non_negative": [-1, 2.0, None, False, "3"],
    "optional_positive": [0, -3, 1.5, True, "8"],
    "flag": [1, 0, None, "yes", np.int64(1)],
}


@st.composite
def rule_calls(draw):
    """(function, kwargs, kinds): valid keyword arguments of a rule entry and the kind of each."""
    block = draw(st.sampled_from([16, 48, 64, 200]))
    hash_block = draw(st.sampled_from([h for h in (1, 4, 8, 16, 48, 64, 200) if block % h == 0]))
    qs = draw(st.integers(0, 6)) * hash_block
    qe = qs + draw(st.integers(0, 4 * block))
    alignment = draw(st.sampled_from([None, 1, 8, 16]))
    which = draw(st.sampled_from(["position", "valid", "row", "prefill", "grid", "column", "split"]))
    if which == "position":
        return checkpoint_position, dict(num_tokens=qe, hash_block_size=hash_block,
                                         drop_eagle_block=draw(st.booleans()),
                                         num_hash_lookahead_tokens=draw(st.integers(0, 3))), \
            dict(num_tokens="non_negative", hash_block_size="positive", drop_eagle_block="flag",
                 num_hash_lookahead_tokens="non_negative")
    if which == "valid":
        return is_checkpoint_valid, dict(query_start=qs, query_end=qe, position=draw(st.integers(0, qe + block)),
                                         hash_block_size=hash_block, block_size=block, alignment=alignment), \
            dict(query_start="non_negative", query_end="non_negative", position="non_negative",
                 hash_block_size="positive", block_size="positive", alignment="optional_positive")
    if which == "row":
        return row_checkpoints, dict(query_start=qs, query_end=qe, hash_block_size=hash_block, block_size=block,
                                     alignment=alignment, max_checkpoints_per_row=draw(st.integers(1, 4)),
                                     policy="every_block", drop_eagle_block=draw(st.booleans())), \
            dict(query_start="non_negative", query_end="non_negative", hash_block_size="positive",
                 block_size="positive", alignment="optional_positive", max_checkpoints_per_row="positive",
                 drop_eagle_block="flag")
    if which == "prefill":
        return (lambda **kw: prefill_checkpoints([qs, 0], [qe, qe], **kw)[0].tolist()), \
            dict(hash_block_size=hash_block, block_size=block, alignment=alignment,
                 cache_hit_alignment_tokens=draw(st.sampled_from([None, hash_block])),
                 num_hash_lookahead_tokens=draw(st.integers(0, 3))), \
            dict(hash_block_size="positive", block_size="positive", alignment="optional_positive",
                 cache_hit_alignment_tokens="optional_positive", num_hash_lookahead_tokens="non_negative")
    if which == "grid":
        unit = draw(st.sampled_from([None, hash_block]))
        # the block is the grid without a prefix-match unit, and may be left out with one
        return checkpoint_grid, dict(alignment=draw(st.sampled_from([1, 8, 16])), prefix_match_unit=unit,
                                     block_size=block), \
            dict(alignment="positive", prefix_match_unit="optional_positive",
                 block_size="positive" if unit is None else "optional_positive")
    if which == "column":
        return (lambda **kw: (checkpoint_column(kw["query_end"], kw["block_size"]),
                              initial_state_column(kw["query_start"], kw["block_size"]))), \
            dict(query_start=qs, query_end=qe, block_size=block), \
            dict(query_start="non_negative", query_end="non_negative", block_size="positive")
    config = dict(block_size=block, hash_block_size=hash_block, checkpoint_alignment=draw(st.sampled_from([1, 16])),
                  has_checkpoint_blocks=draw(st.booleans()), max_num_scheduled_tokens=draw(st.integers(1, 4 * block)))
    kinds = dict(block_size="positive", hash_block_size="optional_positive", checkpoint_alignment="optional_positive",
                 has_checkpoint_blocks="flag", max_num_scheduled_tokens="positive", num_computed_tokens="non_negative",
                 num_new_tokens="non_negative")
    prompt = qe + 1

    def split(*, num_computed_tokens, num_new_tokens, **fields):
        return block_aligned_split(SchedulerConfig(**fields), num_prompt_tokens=prompt, num_tokens=prompt,
                                   num_computed_tokens=num_computed_tokens, num_new_tokens=num_new_tokens)
    return split, dict(config, num_computed_tokens=qs, num_new_tokens=qe - qs), kinds


def _as_numpy(value, dtype):
    if isinstance(value, bool) or value is None or not isinstance(value, int) or value >= np.iinfo(dtype).max:
        return value
    return dtype(value)


@settings(max_examples=300, deadline=None)
@given(rule_calls(), st.data())
def test_fuzzed_rules_numpy_scalars_answer_as_ints_and_one_bad_argument_is_named(call, data):
    function, kwargs, kinds = call
    expected = function(**kwargs)
    dtype = data.draw(st.sampled_from(INT_DTYPES))
    assert function(**{k: _as_numpy(v, dtype) for k, v in kwargs.items()}) == expected
    name = data.draw(st.sampled_from(sorted(kinds)))
    bad = data.draw(st.sampled_from(BAD[kinds[name]]))
    with pytest.raises(ValueError, match=f"^{name}:"):
        function(**{**kwargs, name: bad})


def test_every_public_function_is_in_the_catalogue():
    import jaxckpt.plan as plan
    public = {name for name in dir(plan) if callable(getattr(plan, name)) and not name.startswith("_")
              and not isinstance(getattr(plan, name), type)}
    source = open(__file__).read()
    aliases = {"get_mamba_prefill_checkpoint_position", "is_mamba_prefill_checkpoint_valid"}
    missing = {name for name in public - aliases if f"{name}(" not in source}
    assert not missing
