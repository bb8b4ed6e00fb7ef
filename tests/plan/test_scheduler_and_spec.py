"""The align-mode split on vLLM 0.33.0's documented cases, and the all-or-nothing spec derivation."""

import pytest

from jaxckpt.plan.scheduler import SchedulerConfig, block_aligned_split
from jaxckpt.plan.spec import StateSpec, derive_checkpoint_fields, derive_spec, hybrid_block_sizes


def split(prompt, computed, offered, block, hash_block, alignment, *, checkpoints, eagle=False, budget=16384):
    config = SchedulerConfig(block_size=block, hash_block_size=hash_block, has_checkpoint_blocks=checkpoints,
                             checkpoint_alignment=alignment if checkpoints else None, eagle_block_drop=eagle,
                             max_num_scheduled_tokens=budget)
    return block_aligned_split(config, num_prompt_tokens=prompt, num_tokens=prompt, num_computed_tokens=computed,
                               num_new_tokens=offered)


@pytest.mark.parametrize("case, without, with_checkpoints", [
    ((8000, 0, 8000, 768, 768, 1), 7680, 8000),
    ((2002, 0, 2002, 1600, 16, 1), 1600, 2002),
    ((3602, 0, 2000, 1600, 16, 1), 1600, 1600),
    ((1159, 0, 1159, 1152, 1152, 16), 1152, 1159),
    ((5000, 331, 4669, 1600, 1600, 1), 1269, 1269),
])
def test_vllm_0_33_split_table(case, without, with_checkpoints):
    assert split(*case, checkpoints=False) == without
    assert split(*case, checkpoints=True) == with_checkpoints


def test_eagle_and_budget_cases():
    assert split(3602, 0, 3602, 1600, 16, 1, checkpoints=True, eagle=True) == 3602
    assert split(5000, 0, 1000, 1600, 1600, 1, checkpoints=False, budget=1000) == 1000


def test_one_forward_instead_of_two():
    steps = []
    done = 0
    while done < 8000:
        done += split(8000, done, 8000 - done, 768, 768, 1, checkpoints=False)
        steps.append(done)
    assert steps == [7680, 8000]
    assert split(8000, 0, 8000, 768, 768, 1, checkpoints=True) == 8000


def test_scheduler_config_rules():
    with pytest.raises(ValueError, match="hash_block_size"):
        SchedulerConfig(block_size=768, hash_block_size=500)
    with pytest.raises(ValueError, match="checkpoint_alignment"):
        SchedulerConfig(block_size=768, has_checkpoint_blocks=True)
    with pytest.raises(ValueError, match="eagle_block_drop"):
        SchedulerConfig(block_size=768, eagle_block_drop=True, num_hash_lookahead_tokens=2)
    with pytest.raises(ValueError, match="num_new_tokens"):
        block_aligned_split(SchedulerConfig(block_size=16), num_prompt_tokens=10, num_tokens=10,
                            num_computed_tokens=0, num_new_tokens=-1)


GDN_STATE = dict(block_size=528, shapes=((3, 8192), (32, 128, 128)), dtypes=("bfloat16", "float32"))


def test_derivation_is_all_or_nothing_and_fields_agree():
    base = StateSpec(**GDN_STATE, mamba_cache_mode="align")
    assert derive_spec(base, [1, 1, 16]).num_prefill_checkpoint_blocks == 1
    assert derive_spec(base, [1, 1, 16]).prefill_checkpoint_alignment == 16
    off = derive_spec(base, [1, None, 16])
    assert (off.num_prefill_checkpoint_blocks, off.prefill_checkpoint_alignment) == (0, None)
    assert derive_checkpoint_fields([1], mamba_cache_mode="all") == (0, None)
    assert derive_checkpoint_fields([1], mamba_cache_mode="none") == (0, None)
    with pytest.raises(ValueError, match="must be set together"):
        StateSpec(**GDN_STATE, num_prefill_checkpoint_blocks=1)


def test_extended_mode_accounts_the_extra_resident_blocks():
    base = StateSpec(**GDN_STATE, mamba_cache_mode="align", num_speculative_blocks=1)
    spec = derive_spec(base, [1], max_checkpoints_per_row=3)
    assert spec.num_prefill_checkpoint_blocks == 3
    assert spec.max_memory_usage_bytes() == spec.page_size_bytes * (2 + 1 + 3)
    assert spec.max_num_blocks_per_req(8000) == -(-8000 // 528) + 1


def test_hybrid_block_size_holds_one_state_per_page():
    sizes = hybrid_block_sizes(mamba_page_bytes=2146304, attention_page_bytes_per_token=512, cache_block_size=16,
                               min_kernel_block_size=16, checkpoint_alignment=64)
    assert sizes.block_size % 64 == 0 and sizes.block_size * 512 >= 2146304
    assert (sizes.block_size - 64) * 512 < 2146304
    assert sizes.mamba_block_size == sizes.block_size and sizes.mamba_page_size_padded == sizes.block_size * 512
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        hybrid_block_sizes(mamba_page_bytes=1, attention_page_bytes_per_token=1, cache_block_size=16,
                           min_kernel_block_size=16, mamba_cache_mode="some")
