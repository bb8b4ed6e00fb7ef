"""The Triton SSD with checkpoints against the float64 reference: varlen rows, checkpoints anywhere, pools, bad input.

Without a GPU the kernels run in Triton's interpreter (this module sets TRITON_INTERPRET=1 when no GPU is present and
the kernel module is not loaded yet), at tiny float32 shapes; bfloat16 inputs are in tests/gpu.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.torch_bridge.helpers import assert_each_raises, check_outputs, triton_device, two_row_paged_options  # noqa: E402

DEVICE = triton_device("torch_bridge.ops.ssd")

from jaxckpt.ops.ssd.reference import ssd as reference  # noqa: E402
from jaxckpt.plan.conventions import NULL_SLOT, PAD_CHECKPOINT_OFFSET  # noqa: E402
from tests.vectors.loader import check_case, load_cases, rel_rms  # noqa: E402
from torch_bridge.ops.ssd import ssd, ssd_paged  # noqa: E402

BOUND = 1e-5


def tensor(array, dtype=torch.float32):
    return torch.as_tensor(np.array(array), dtype=dtype, device=DEVICE)


def problem(rng, lengths, *, heads=4, dim_p=8, groups=2, dim_n=16, pad=3):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    num_tokens = int(cu[-1]) + pad
    arrays = dict(
        x=rng.standard_normal((num_tokens, heads, dim_p)),
        dt=rng.standard_normal((num_tokens, heads)) - 1.0,
        A=-np.exp(rng.uniform(-1, 1, heads)),
        B=rng.standard_normal((num_tokens, groups, dim_n)),
        C=rng.standard_normal((num_tokens, groups, dim_n)),
        D=rng.standard_normal((heads, dim_p)),
        dt_bias=rng.standard_normal(heads) * 0.5,
        z=rng.standard_normal((num_tokens, heads, dim_p)),
        initial_state=rng.standard_normal((len(lengths), heads, dim_p, dim_n)),
    )
    return {name: a.astype(np.float32) for name, a in arrays.items()}, cu


def torch_args(arrays):
    return {name: tensor(a) for name, a in arrays.items()}


def check_against_reference(arrays, out, **options):
    check_outputs(out, reference(**arrays, **options), options["cu_seqlens"], options["checkpoint_cu"], bound=BOUND)


def test_varlen_rows_with_checkpoints_anywhere_match_reference():
    rng = np.random.default_rng(301)
    # rows: two chunks, empty, one token, three chunks, short; checkpoints at 1, len - 1, chunk edges and inside
    arrays, cu = problem(rng, [70, 0, 1, 130, 5])
    ccu = np.array([0, 3, 3, 3, 7, 8], np.int32)
    offsets = np.array([1, 64, 69, 1, 63, 65, 129, 4, PAD_CHECKPOINT_OFFSET, PAD_CHECKPOINT_OFFSET], np.int32)
    options = dict(cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets)
    out = ssd(**torch_args(arrays), **options)
    assert out[0].dtype == torch.float32 and out[1].dtype == out[2].dtype == torch.float32
    assert out[2].shape == (offsets.size, 4, 8, 16)
    check_against_reference(arrays, out, **options)
    # the empty row keeps its initial state exactly
    assert torch.equal(out[1][1], tensor(arrays["initial_state"][1]))


def test_kv_layout_dt_limit_strided_x_and_head_vector_d():
    rng = np.random.default_rng(302)
    arrays, cu = problem(rng, [40, 90], groups=1, pad=0)
    arrays["D"] = arrays["D"][:, 0].copy()
    arrays["initial_state"] = np.swapaxes(arrays["initial_state"], -1, -2).copy()
    del arrays["z"]
    args = torch_args(arrays)
    band = torch.zeros((args["x"].shape[0], 4, 8 + 5), device=DEVICE)
    band[:, :, 2:10] = args["x"]
    args["x"] = band[:, :, 2:10]  # a column band: stride(1) = 13, not contiguous
    assert not args["x"].is_contiguous()
    options = dict(cu_seqlens=cu, checkpoint_cu=np.array([0, 1, 3], np.int32),
                   checkpoint_offsets=np.array([39, 2, 64], np.int32), dt_limit=(0.05, 0.6), state_layout="kv")
    out = ssd(**args, **options)
    assert out[1].shape == (2, 4, 16, 8)
    check_against_reference(arrays, out, **options)


def test_checkpoints_leave_outputs_and_final_states_bitwise_unchanged():
    rng = np.random.default_rng(303)
    arrays, cu = problem(rng, [100, 30])
    args = torch_args(arrays)
    plain = ssd(**args, cu_seqlens=cu)
    with_ckpt = ssd(**args, cu_seqlens=cu, checkpoint_cu=np.array([0, 2, 3], np.int32),
                    checkpoint_offsets=np.array([17, 64, 29], np.int32))
    assert torch.equal(plain[0], with_ckpt[0]) and torch.equal(plain[1], with_ckpt[1])
    assert plain[2].shape == (0, 4, 8, 16)


def test_shared_vectors_fp32_cases():
    cases = [c for c in load_cases("ssd") if c.tolerance_class == "fp32"]
    assert len(cases) >= 5
    metadata = ("cu_seqlens", "checkpoint_cu", "checkpoint_offsets")
    for case in cases:
        args = {name: a if name in metadata else tensor(a) for name, a in case.inputs.items()}
        options = {**case.options}
        if options.get("dt_limit") is not None:
            options["dt_limit"] = tuple(options["dt_limit"])
        check_case(case, ssd(**args, **options))


def test_paged_pool_reads_and_writes_only_named_slots():
    rng = np.random.default_rng(304)
    arrays, cu = problem(rng, [66, 3, 20])
    num_slots = 10
    pool = torch.full((num_slots, 4, 8, 16), float("nan"), device=DEVICE)
    pool[3] = tensor(arrays["initial_state"][0])
    pool[5] = tensor(arrays["initial_state"][2])
    initial = np.array([3, -1, 5])          # row 1 reads nothing (vLLM -1)
    has_initial = np.array([True, True, False])  # row 2 is fresh although its slot holds a state
    final = np.array([3, 7, -1])           # row 0 writes back in place; row 2's final is dropped
    ccu = np.array([0, 2, 2, 3], np.int32)
    offsets = np.array([1, 65, 19, PAD_CHECKPOINT_OFFSET], np.int32)
    ckpt_slots = np.array([8, NULL_SLOT, 9, 4])  # padded entry names slot 4: still written nowhere
    options = dict(cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets)
    args = torch_args({k: v for k, v in arrays.items() if k != "initial_state"})
    y = ssd_paged(**args, state_pool=pool, initial_state_indices=initial, has_initial_state=has_initial,
                  final_state_indices=final, checkpoint_state_indices=ckpt_slots, **options)
    h0 = arrays["initial_state"].copy()
    h0[1] = 0.0
    h0[2] = 0.0
    expected = reference(**{**arrays, "initial_state": h0}, **options)
    assert rel_rms(y[:int(cu[-1])], expected[0][:int(cu[-1])]) <= BOUND
    for slot, state in ((3, expected[1][0]), (7, expected[1][1]), (8, expected[2][0]), (9, expected[2][2])):
        assert rel_rms(pool[slot], state) <= BOUND, slot
    untouched = [0, 1, 2, 4, 6]
    assert torch.isnan(pool[untouched]).all()
    assert torch.equal(pool[5], tensor(arrays["initial_state"][2]))


def test_bad_input_raises_before_any_write():
    rng = np.random.default_rng(305)
    arrays, cu = problem(rng, [10, 6])
    args = torch_args({k: v for k, v in arrays.items() if k != "initial_state"})
    pool = torch.full((4, 4, 8, 16), float("nan"), device=DEVICE)
    base = two_row_paged_options(cu)
    bad = [
        ("B", dict(B=args["B"].half())),
        ("C", dict(C=args["C"][:, :1])),
        ("dt", dict(dt=args["dt"].to("meta"))),
        ("x", dict(x=args["x"][None])),
        ("D", dict(D=args["D"][:, :3])),
        ("checkpoint_offsets", dict(checkpoint_offsets=np.array([10]))),
        ("cu_seqlens", dict(cu_seqlens=np.array([0, 10, 50]))),
        ("final_state_indices", dict(final_state_indices=[1, 4])),
        ("checkpoint_state_indices", dict(checkpoint_state_indices=[-2])),
        ("final_state_indices/checkpoint_state_indices", dict(checkpoint_state_indices=[2])),
        ("state_pool", dict(state_pool=pool[:, :, :, :8])),
        ("state_layout", dict(state_layout="pk")),
        ("dt_limit", dict(dt_limit=(1.0, 0.5))),
        ("dot_precision", dict(dot_precision="bf16")),
    ]
    assert_each_raises(ssd_paged, bad, **args, state_pool=pool, **base)
    assert torch.isnan(pool).all()
    with pytest.raises(ValueError, match="^initial_state"):
        ssd(**args, initial_state=tensor(arrays["initial_state"]).double(), cu_seqlens=cu)
