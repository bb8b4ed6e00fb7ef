"""Helpers of the torch_bridge tests: where Triton kernels run here, and the check of an op's three outputs."""

import os
import sys

import numpy as np
import pytest
import torch

from tests.numerics import rel_rms


def triton_device(kernel_module: str) -> str:
    """"cuda", or "cpu" in Triton's interpreter; skips the calling module where neither can run.

    Without a GPU it sets TRITON_INTERPRET=1 unless `kernel_module` is loaded already (its kernels were decorated
    without the interpreter), so call it before importing the kernels.
    """
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and kernel_module not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1 set before triton is imported",
                    allow_module_level=True)
    return "cuda"


def check_outputs(out, expected, cu_seqlens, checkpoint_cu, *, bound: float) -> None:
    """(outputs, final states, checkpoint states) against a float64 reference's, each real checkpoint on its own;
    padding tokens and padded checkpoint entries must be zeros."""
    valid = int(cu_seqlens[-1])
    assert rel_rms(out[0][:valid], expected[0][:valid]) <= bound
    assert torch.count_nonzero(out[0][valid:]) == 0
    assert rel_rms(out[1], expected[1]) <= bound
    real = int(checkpoint_cu[-1])
    for m in range(real):
        assert rel_rms(out[2][m], expected[2][m]) <= bound, m
    assert torch.count_nonzero(out[2][real:]) == 0


def assert_each_raises(op, bad, **call) -> None:
    """For every (name, change) in `bad`, `op(**call, **change)` raises a ValueError whose message starts with name."""
    for name, change in bad:
        with pytest.raises(ValueError, match=f"^{name}"):
            op(**{**call, **change})


def two_row_paged_options(cu_seqlens) -> dict:
    """Valid metadata of a paged call over two rows and a 4-slot pool: row 0 resumes from slot 1 and has one
    checkpoint at 3 (to slot 3), row 1 starts fresh; final states go to slots 1 and 2."""
    return dict(cu_seqlens=cu_seqlens, checkpoint_cu=np.array([0, 1, 1], np.int32), checkpoint_offsets=np.array([3]),
                initial_state_indices=[1, 2], has_initial_state=np.array([True, False]), final_state_indices=[1, 2],
                checkpoint_state_indices=[3])
