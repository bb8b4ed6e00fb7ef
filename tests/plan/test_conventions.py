"""Metadata validation, CSR padding and the vLLM per-row conversions."""

import numpy as np
import pytest

from jaxckpt.plan import (NULL_SLOT, PAD_CHECKPOINT_OFFSET, checkpoint_rows, checkpoints_from_rows,
                          checkpoints_to_rows, map_vllm_slots, pad_checkpoints, validate_checkpoints,
                          validate_cu_seqlens, validate_slots)


def test_cu_seqlens_defaults_to_one_row_and_allows_padding_tokens():
    assert validate_cu_seqlens(None, 7).tolist() == [0, 7]
    assert validate_cu_seqlens([0, 3, 3, 5], 8).dtype == np.int32


@pytest.mark.parametrize("cu, message", [
    ([0, 3, 2], "non-decreasing"), ([1, 3], "start at 0"), ([0, 9], "exceeds"), ([[0, 1]], "1-D"), ([0], "at least"),
    ([0, -1], "non-decreasing"), ([0.5, 1], "integers"),
])
def test_bad_cu_seqlens(cu, message):
    with pytest.raises(ValueError, match=f"cu_seqlens.*{message}"):
        validate_cu_seqlens(cu, 8)


def test_checkpoints_validate_and_pad():
    cu = np.array([0, 10, 10, 30])
    ccu, offsets = validate_checkpoints([0, 2, 2, 3, ], [1, 9, 19, 0, 0], cu)
    assert ccu.tolist() == [0, 2, 2, 3] and offsets.tolist() == [1, 9, 19, 0, 0]
    assert checkpoint_rows(ccu, 5).tolist() == [0, 0, 2, -1, -1]
    empty_cu, empty = validate_checkpoints(None, None, cu)
    assert empty_cu.tolist() == [0, 0, 0, 0] and empty.size == 0
    padded, slots = pad_checkpoints(ccu, offsets[:3], 6, checkpoint_state_indices=[4, 5, 6])
    assert padded.tolist() == [1, 9, 19] + [PAD_CHECKPOINT_OFFSET] * 3
    assert slots.tolist() == [4, 5, 6] + [NULL_SLOT] * 3


@pytest.mark.parametrize("ccu, offsets, message", [
    ([0, 1, 1, 1], [10], "outside"), ([0, 1, 1, 1], [0], "outside"), ([0, 2, 2, 2], [5, 5], "ascending"),
    ([0, 2, 2, 2], [6, 5], "ascending"), ([0, 1, 1], [5], "N \\+ 1"), ([0, 1, 1, 2], [5], "exceeds"),
    ([0, 1, 1, 1], [5, 3], "padded"), ([1, 1, 1, 1], [5], "start at 0"),
])
def test_bad_checkpoints(ccu, offsets, message):
    with pytest.raises(ValueError, match=f"checkpoint_(cu|offsets).*{message}"):
        validate_checkpoints(ccu, offsets, np.array([0, 10, 10, 30]))


def test_one_of_the_pair_missing():
    with pytest.raises(ValueError, match="both or neither"):
        validate_checkpoints([0, 0], None, np.array([0, 4]))


def test_vllm_per_row_round_trip():
    offsets, columns = np.array([192, 0, 64]), np.array([2, -1, 0])
    ccu, flat, flat_columns = checkpoints_from_rows(offsets, columns)
    assert ccu.tolist() == [0, 1, 1, 2] and flat.tolist() == [192, 64] and flat_columns.tolist() == [2, 0]
    back_offsets, back_columns = checkpoints_to_rows(ccu, flat, flat_columns)
    assert back_offsets.tolist() == offsets.tolist() and back_columns.tolist() == columns.tolist()
    # FlashKDA's [N, K <= 2] form
    two = np.array([[64, 128], [0, 0], [16, 0]])
    ccu, flat, _ = checkpoints_from_rows(two)
    assert ccu.tolist() == [0, 2, 2, 3]
    assert checkpoints_to_rows(ccu, flat, max_per_row=2).tolist() == two.tolist()
    with pytest.raises(ValueError, match="max_per_row"):
        checkpoints_to_rows(ccu, flat, max_per_row=1)


def test_slots():
    assert map_vllm_slots([-1, 3, -1, 0]).tolist() == [NULL_SLOT, 3, NULL_SLOT, 0]
    with pytest.raises(ValueError, match="indices"):
        map_vllm_slots([-2])
    assert validate_slots([0, 3], 4, name="final_state_indices").tolist() == [0, 3]
    with pytest.raises(ValueError, match="final_state_indices.*outside"):
        validate_slots([4], 4, name="final_state_indices")
    with pytest.raises(ValueError, match="initial_state_indices.*outside"):
        validate_slots([0], 4, name="initial_state_indices", allow_null=False)
