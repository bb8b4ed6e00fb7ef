"""The rule set on hand-checked cases from vLLM's own tests and docs, plus properties over sweeps."""

import itertools

import numpy as np
import pytest

from jaxckpt.plan import (batch_checkpoints, checkpoint_column, checkpoint_grid, checkpoint_position,
                          initial_state_column, is_checkpoint_valid, model_checkpoint_alignment, prefill_checkpoints,
                          row_checkpoints)


@pytest.mark.parametrize("hash_block", [16, 64, 256])
def test_position_is_last_boundary_before_the_last_token_and_eagle_moves_it_one_unit(hash_block):
    num_tokens = 19 * hash_block + 7
    assert checkpoint_position(num_tokens, hash_block) == 19 * hash_block
    assert checkpoint_position(num_tokens, hash_block, drop_eagle_block=True) == 18 * hash_block
    # a prompt ending exactly on a boundary keeps its last token for logits
    assert checkpoint_position(20 * hash_block, hash_block) == 19 * hash_block
    assert checkpoint_position(0, hash_block) == 0


def test_lookahead_leaves_room_for_the_hash_of_the_checkpoint():
    assert checkpoint_position(130, 64, num_hash_lookahead_tokens=2) == 128
    assert checkpoint_position(130, 64, num_hash_lookahead_tokens=3) == 64
    assert checkpoint_position(129, 64, num_hash_lookahead_tokens=0) == checkpoint_position(129, 64,
                                                                                          num_hash_lookahead_tokens=1)


def test_flashkda_reviewer_example_is_declined():
    # vLLM #53614: B=64, H=8, N=100 with EAGLE -> position 88, not a multiple of FlashKDA's 16
    position = checkpoint_position(100, 8, drop_eagle_block=True)
    assert position == 88
    assert not is_checkpoint_valid(0, 100, position, hash_block_size=8, block_size=64, alignment=16)
    assert is_checkpoint_valid(0, 100, position, hash_block_size=8, block_size=64, alignment=8)


def test_rocm_kda_examples():
    offsets, columns = prefill_checkpoints([0, 0], [200, 128], hash_block_size=64, block_size=64, alignment=64)
    assert offsets.tolist() == [192, 64] and columns.tolist() == [2, 0]
    offsets, columns = prefill_checkpoints([256], [400], hash_block_size=64, block_size=64, alignment=64)
    assert offsets.tolist() == [128] and columns.tolist() == [5]
    offsets, columns = prefill_checkpoints([128], [168], hash_block_size=64, block_size=64, alignment=64)
    assert offsets.tolist() == [0] and columns.tolist() == [-1]
    offsets, columns = prefill_checkpoints([0], [700], hash_block_size=128, block_size=256, alignment=64)
    assert offsets.tolist() == [640] and columns.tolist() == [1]


def test_gdn_builder_example_targets_last_aligned_boundary():
    # seq [50, 32] with query [50, 16], B = H = A = 16
    offsets, columns = prefill_checkpoints([0, 16], [50, 32], hash_block_size=16, block_size=16, alignment=16)
    assert offsets.tolist() == [48, 0] and columns.tolist() == [2, -1]


def test_alignment_none_never_exports():
    assert not is_checkpoint_valid(0, 8000, 7680, hash_block_size=768, block_size=768, alignment=None)
    with pytest.raises(ValueError, match="alignment"):
        is_checkpoint_valid(0, 8000, 7680, hash_block_size=768, block_size=768, alignment=0)


@pytest.mark.parametrize("block", [16, 256, 2096])
def test_every_valid_checkpoint_leaves_room_for_the_conv_window(block):
    rng = np.random.default_rng(block)
    for _ in range(3000):
        qs = int(rng.integers(0, 4 * block)) // 16 * 16
        qe = qs + int(rng.integers(1, 4 * block))
        position = checkpoint_position(qe, 16)
        if is_checkpoint_valid(qs, qe, position, hash_block_size=16, block_size=block, alignment=1):
            assert position - qs >= block // 2


def test_valid_checkpoint_lands_in_the_column_before_the_running_state():
    for block, hash_block in [(48, 16), (64, 64)]:
        for qs, qe in itertools.product(range(0, 200, hash_block), range(1, 260)):
            if qe <= qs:
                continue
            position = checkpoint_position(qe, hash_block)
            if is_checkpoint_valid(qs, qe, position, hash_block_size=hash_block, block_size=block, alignment=1):
                column = checkpoint_column(qe, block)
                assert initial_state_column(qs, block) < column < (qe - 1) // block
                # slot p holds the state after (p + 1) * B tokens when the hash unit is the block
                if hash_block == block:
                    assert position == (column + 1) * block


def test_model_alignment_is_lcm_with_none_poisoning():
    assert model_checkpoint_alignment([1, 16, 64]) == 64
    assert model_checkpoint_alignment([16, 24]) == 48
    assert model_checkpoint_alignment([16, None, 64]) is None
    assert model_checkpoint_alignment([]) == 1
    with pytest.raises(ValueError, match="layer_alignments"):
        model_checkpoint_alignment([0])


def test_checkpoint_grid():
    assert checkpoint_grid(16, prefix_match_unit=None, block_size=1152) == 1152
    assert checkpoint_grid(16, prefix_match_unit=24, block_size=1152) == 48
    with pytest.raises(ValueError, match="alignment"):
        checkpoint_grid(None, prefix_match_unit=24, block_size=1152)


def test_extended_mode_adds_block_boundaries_before_the_vllm_checkpoint():
    # vLLM #45238: 1500 shared + 700 unique tokens, block 528; vLLM's checkpoint is at 2112 (unique tokens)
    pairs = row_checkpoints(0, 2200, hash_block_size=528, block_size=528, alignment=1, max_checkpoints_per_row=1)
    assert pairs == [(2112, 3)]
    pairs = row_checkpoints(0, 2200, hash_block_size=528, block_size=528, alignment=1, max_checkpoints_per_row=2,
                            policy="positions", positions=[1500])
    assert pairs == [(1056, 1), (2112, 3)]
    pairs = row_checkpoints(0, 2200, hash_block_size=528, block_size=528, alignment=1, max_checkpoints_per_row=8,
                            policy="every_block")
    assert pairs == [(528, 0), (1056, 1), (1584, 2), (2112, 3)]
    # too many candidates: the latest are kept, vLLM's own first
    pairs = row_checkpoints(0, 2200, hash_block_size=528, block_size=528, alignment=1, max_checkpoints_per_row=2,
                            policy="every_block")
    assert pairs == [(1584, 2), (2112, 3)]


def test_extended_mode_respects_the_rule_and_never_touches_the_initial_column():
    rng = np.random.default_rng(7)
    for _ in range(400):
        block = int(rng.choice([32, 48, 64]))
        hash_block = int(rng.choice([h for h in (16, 32, 48, 64) if block % h == 0]))
        alignment = int(rng.choice([1, 16]))
        qs = int(rng.integers(0, 6)) * hash_block
        qe = qs + int(rng.integers(1, 8 * block))
        pairs = row_checkpoints(qs, qe, hash_block_size=hash_block, block_size=block, alignment=alignment,
                                max_checkpoints_per_row=int(rng.integers(1, 6)), policy="every_block")
        vllm_offsets, _ = prefill_checkpoints([qs], [qe], hash_block_size=hash_block, block_size=block,
                                              alignment=alignment)
        offsets = [o for o, _ in pairs]
        assert offsets == sorted(set(offsets))
        if vllm_offsets[0]:
            assert offsets[-1] == vllm_offsets[0]
        for offset, column in pairs:
            assert is_checkpoint_valid(qs, qe, qs + offset, hash_block_size=hash_block, block_size=block,
                                       alignment=alignment)
            assert initial_state_column(qs, block) < column <= checkpoint_column(qe, block)


def test_batch_checkpoints_is_csr_of_rows():
    cu, offsets, columns = batch_checkpoints([0, 768, 0], [8000, 800, 2200], hash_block_size=768, block_size=768,
                                             alignment=1, max_checkpoints_per_row=3, policy="every_block")
    assert cu.tolist() == [0, 3, 3, 5]
    assert offsets.tolist() == [6144, 6912, 7680, 768, 1536]
    assert columns.tolist() == [7, 8, 9, 0, 1]


@pytest.mark.parametrize("call, name", [
    (lambda: checkpoint_position(-1, 16), "num_tokens"),
    (lambda: checkpoint_position(10, 0), "hash_block_size"),
    (lambda: is_checkpoint_valid(0, 10, 5, hash_block_size=16, block_size=-16, alignment=1), "block_size"),
    (lambda: prefill_checkpoints([5], [3], hash_block_size=1, block_size=1, alignment=1), "query_starts"),
    (lambda: row_checkpoints(0, 10, hash_block_size=1, block_size=1, alignment=1, policy="all"), "policy"),
])
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()
