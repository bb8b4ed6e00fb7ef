"""The Triton checkpoint exporter against independent numpy slicing: exact values, untouched slots, bad input.

Without a GPU the kernel runs in Triton's interpreter (scripts/test sets TRITON_INTERPRET=1; this module sets it too
when no GPU is present and the kernel module is not loaded yet), in float32 and float16; bfloat16 casts need a GPU.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.torch_bridge.helpers import triton_device  # noqa: E402

DEVICE = triton_device("torch_bridge.ops.exporter")

from jaxckpt.plan.conventions import NULL_SLOT  # noqa: E402
from torch_bridge.ops import export_checkpoints  # noqa: E402


def tensor(array, dtype=torch.float32):
    return torch.as_tensor(np.asarray(array), dtype=dtype, device=DEVICE)


def nan_pool(shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def conv_windows(x, cu, ccu, offsets, width, initial):
    """[M_real, D, W - 1]: for each real checkpoint, the W - 1 raw inputs before it, oldest first."""
    out = []
    for n in range(len(cu) - 1):
        history = np.concatenate([initial[n].T, x[cu[n]:cu[n + 1]]])  # position i - (W - 1) at index i
        for m in range(ccu[n], ccu[n + 1]):
            out.append(history[offsets[m]:offsets[m] + width - 1].T)
    return np.asarray(out)


def batch(rng, *, dim=6, query_lens=(21, 3, 40, 9), max_per_row=3, pad=2, small=(1, 2)):
    """Random rows and a CSR checkpoint list: rows with none, several, and offsets from `small` (below W - 1)."""
    cu = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    counts, offsets = [], []
    for n, length in enumerate(query_lens):
        k = int(rng.integers(0 if n else 1, min(max_per_row, length - 1) + 1))
        row = set(rng.choice(np.arange(1, length), size=k, replace=False).tolist())
        if n == 0:
            row.add(small[0])
        if n == 2:
            row.add(small[-1])
        offsets += sorted(row)
        counts.append(len(row))
    ccu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    offsets = np.asarray(offsets + [0] * pad, np.int32)
    x = rng.standard_normal((int(cu[-1]) + 5, dim)).astype(np.float32)  # 5 padding tokens after the rows
    return x, cu, ccu, offsets


def slots_for(rng, ccu, num_entries, num_slots, *, declined=1):
    """Distinct non-null slots for real entries (the last `declined` get the null slot), arbitrary slots for padding."""
    num_real = int(ccu[-1])
    slots = rng.permutation(np.arange(1, num_slots))[:num_entries].astype(np.int32)
    slots[num_real - declined:num_real] = NULL_SLOT
    return slots


def test_conv_half_matches_slicing_with_incoming_states_and_untouched_slots():
    rng = np.random.default_rng(101)
    width = 4
    x, cu, ccu, offsets = batch(rng)
    num_real, num_slots = int(ccu[-1]), 2 * offsets.size + 2
    slots = slots_for(rng, ccu, offsets.size, num_slots)
    initial = rng.standard_normal((cu.size - 1, x.shape[1], width - 1)).astype(np.float32)
    pool = nan_pool((num_slots, x.shape[1], width - 1))
    export_checkpoints(tensor(x), pool, tensor(cu, torch.int32), tensor(ccu, torch.int32),
                       tensor(offsets, torch.int32), tensor(slots, torch.int32), initial_conv_states=tensor(initial))
    want = conv_windows(x, cu, ccu, offsets, width, initial)
    got = pool.cpu().numpy()
    written = slots[:num_real - 1]
    np.testing.assert_array_equal(got[written], want[:num_real - 1])
    untouched = np.setdiff1d(np.arange(num_slots), written)
    assert NULL_SLOT in untouched and np.isnan(got[untouched]).all()
    assert np.any(offsets[:num_real - 1] < width - 1), "the batch must exercise the incoming-state path"


def states_like(rng, count, heads, k, v, layout):
    shape = (count, heads, k, v) if layout == "kv" else (count, heads, v, k)
    return rng.standard_normal(shape).astype(np.float32)


def as_layout(states, source_layout, state_layout):
    return states if source_layout == state_layout else np.swapaxes(states, -1, -2)


@pytest.mark.parametrize("conv_layout", ["dim_first", "transposed"])
@pytest.mark.parametrize("source_layout,state_layout", [("kv", "kv"), ("kv", "vk"), ("vk", "kv"), ("vk", "vk")])
def test_both_halves_in_every_layout(conv_layout, source_layout, state_layout):
    rng = np.random.default_rng(["kv", "vk"].index(source_layout) * 4 + ["kv", "vk"].index(state_layout) * 2
                                + ["dim_first", "transposed"].index(conv_layout) + 200)
    width, heads, k, v = 3, 2, 4, 5
    x, cu, ccu, offsets = batch(rng)
    num_real, num_slots = int(ccu[-1]), offsets.size + 6
    slots = slots_for(rng, ccu, offsets.size, num_slots)
    dim = x.shape[1]
    if conv_layout == "dim_first":
        conv_pool = nan_pool((num_slots, dim, width - 1))
    else:
        conv_pool = nan_pool((num_slots, width - 1, dim)).transpose(1, 2)
    source = states_like(rng, offsets.size, heads, k, v, source_layout)
    pool_shape = (num_slots, heads, k, v) if state_layout == "kv" else (num_slots, heads, v, k)
    state_pool = nan_pool(pool_shape)
    export_checkpoints(tensor(x), conv_pool, cu, ccu, offsets, slots, recurrent_checkpoints=tensor(source),
                       recurrent_state_pool=state_pool, source_layout=source_layout, state_layout=state_layout)
    written = slots[:num_real - 1]
    zeros = np.zeros((cu.size - 1, dim, width - 1), np.float32)
    np.testing.assert_array_equal(conv_pool.cpu().numpy()[written],
                                  conv_windows(x, cu, ccu, offsets, width, zeros)[:num_real - 1])
    np.testing.assert_array_equal(state_pool.cpu().numpy()[written],
                                  as_layout(source[:num_real - 1], source_layout, state_layout))
    untouched = np.setdiff1d(np.arange(num_slots), written)
    assert np.isnan(conv_pool.cpu().numpy()[untouched]).all() and np.isnan(state_pool.cpu().numpy()[untouched]).all()


def test_row_strided_input_band_of_a_fused_projection():
    rng = np.random.default_rng(301)
    width, dim = 4, 5
    x, cu, ccu, offsets = batch(rng, dim=dim)
    fused = tensor(rng.standard_normal((x.shape[0], 4 * dim + 3)))
    band = fused[:, dim:3 * dim:2]  # stride (4D + 3, 2): a strided column band
    assert band.stride() == (4 * dim + 3, 2)
    num_slots = offsets.size + 3
    slots = slots_for(rng, ccu, offsets.size, num_slots, declined=0)
    pool = nan_pool((num_slots, dim, width - 1))
    export_checkpoints(band, pool, cu, ccu, offsets, slots)
    zeros = np.zeros((cu.size - 1, dim, width - 1), np.float32)
    want = conv_windows(band.cpu().numpy(), cu, ccu, offsets, width, zeros)
    np.testing.assert_array_equal(pool.cpu().numpy()[slots[:ccu[-1]]], want)


def test_incoming_states_from_a_pool_with_vllm_slots():
    rng = np.random.default_rng(401)
    width, dim = 4, 3
    query_lens = (10, 12, 8, 9)
    cu = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    ccu = np.array([0, 2, 3, 4, 6], np.int32)
    offsets = np.array([1, 7, 2, 1, 2, 5], np.int32)
    x = rng.standard_normal((int(cu[-1]), dim)).astype(np.float32)
    num_slots = 16
    # vLLM pads with -1; slot 0 is the null block in vLLM and here: both mean "write nothing" / "no state".
    slots = np.array([3, 4, 9, -1, 11, 12], np.int32)
    initial_slots = np.array([6, -1, NULL_SLOT, 8], np.int32)
    has_initial_state = np.array([True, True, True, False])
    initial_pool = rng.standard_normal((num_slots, width - 1, dim)).astype(np.float32)  # stored [S, W - 1, D]
    pool = nan_pool((num_slots, dim, width - 1))
    export_checkpoints(tensor(x), pool, cu, ccu, offsets, tensor(slots, torch.int64),
                       initial_conv_states=tensor(initial_pool).transpose(1, 2),
                       initial_state_indices=initial_slots, has_initial_state=torch.as_tensor(has_initial_state))
    incoming = np.zeros((cu.size - 1, dim, width - 1), np.float32)
    incoming[0] = initial_pool[6].T  # rows 1 (-1), 2 (null) and 3 (has_initial_state False) start fresh
    want = conv_windows(x, cu, ccu, offsets, width, incoming)
    got = pool.cpu().numpy()
    for m in (0, 1, 2, 4, 5):
        np.testing.assert_array_equal(got[slots[m]], want[m])
    assert np.isnan(np.delete(got, slots[[0, 1, 2, 4, 5]], axis=0)).all()


def test_conv_window_is_the_conv1d_reference_checkpoint_state():
    pytest.importorskip("jax")
    from jaxckpt.ops.conv1d.reference import causal_conv1d

    rng = np.random.default_rng(501)
    width = 4
    x, cu, ccu, offsets = batch(rng, small=(1, 2))
    dim = x.shape[1]
    initial = rng.standard_normal((cu.size - 1, dim, width - 1)).astype(np.float32)
    weight = rng.standard_normal((dim, width)).astype(np.float32)
    _, _, checkpoint_states = causal_conv1d(x, weight, initial_state=initial, cu_seqlens=cu, checkpoint_cu=ccu,
                                            checkpoint_offsets=offsets)
    num_slots = offsets.size + 1
    slots = np.arange(1, offsets.size + 1, dtype=np.int32)
    pool = nan_pool((num_slots, dim, width - 1))
    export_checkpoints(tensor(x), pool, cu, ccu, offsets, slots, initial_conv_states=tensor(initial))
    np.testing.assert_array_equal(pool.cpu().numpy()[slots[:ccu[-1]]],
                                  checkpoint_states[:ccu[-1]].astype(np.float32))


def test_row_ids_pick_states_out_of_all_chunk_states():
    rng = np.random.default_rng(601)
    x, cu, ccu, offsets = batch(rng)
    num_real, num_slots, num_chunks = int(ccu[-1]), offsets.size + 4, 11
    slots = slots_for(rng, ccu, offsets.size, num_slots, declined=0)
    chunk_states = states_like(rng, num_chunks, 3, 4, 4, "kv")
    row_ids = rng.integers(0, num_chunks, offsets.size).astype(np.int32)
    row_ids[num_real:] = 99  # padded entries are never read, whatever they hold
    state_pool = nan_pool((num_slots, 3, 4, 4))
    conv_pool = nan_pool((num_slots, x.shape[1], 3))
    export_checkpoints(tensor(x), conv_pool, cu, ccu, offsets, slots, recurrent_checkpoints=tensor(chunk_states),
                       recurrent_state_pool=state_pool, recurrent_row_ids=row_ids)
    np.testing.assert_array_equal(state_pool.cpu().numpy()[slots[:num_real]], chunk_states[row_ids[:num_real]])
    assert np.isnan(np.delete(state_pool.cpu().numpy(), slots[:num_real], axis=0)).all()


def test_padded_pages_and_a_spec_widened_conv_row_keep_their_tails():
    rng = np.random.default_rng(701)
    width, heads, k, v, num_spec = 4, 2, 3, 4, 2
    x, cu, ccu, offsets = batch(rng, dim=5)
    dim, num_real, num_slots = x.shape[1], int(ccu[-1]), offsets.size + 2
    conv_elems, state_elems, page = dim * (width - 1 + num_spec), heads * k * v, 128
    pages = nan_pool((num_slots, page))  # vLLM binds both states into one padded page per slot
    conv_pool = pages[:, :conv_elems].view(num_slots, dim, width - 1 + num_spec)
    state_pool = pages[:, conv_elems:conv_elems + state_elems].view(num_slots, heads, k, v)
    source = states_like(rng, offsets.size, heads, k, v, "kv")
    slots = slots_for(rng, ccu, offsets.size, num_slots, declined=0)
    export_checkpoints(tensor(x), conv_pool, cu, ccu, offsets, slots, conv_width=width,
                       recurrent_checkpoints=tensor(source), recurrent_state_pool=state_pool)
    got = pages.cpu().numpy()[slots[:num_real]]
    zeros = np.zeros((cu.size - 1, dim, width - 1), np.float32)
    conv = got[:, :conv_elems].reshape(num_real, dim, width - 1 + num_spec)
    np.testing.assert_array_equal(conv[..., :width - 1], conv_windows(x, cu, ccu, offsets, width, zeros))
    assert np.isnan(conv[..., width - 1:]).all()
    np.testing.assert_array_equal(got[:, conv_elems:conv_elems + state_elems],
                                  source[:num_real].reshape(num_real, -1))
    assert np.isnan(got[:, conv_elems + state_elems:]).all()
    assert np.isnan(np.delete(pages.cpu().numpy(), slots[:num_real], axis=0)).all()


def test_float16_pools_round_like_torch():
    rng = np.random.default_rng(801)
    x, cu, ccu, offsets = batch(rng)
    num_real, num_slots = int(ccu[-1]), offsets.size + 2
    slots = slots_for(rng, ccu, offsets.size, num_slots, declined=0)
    source = tensor(states_like(rng, offsets.size, 2, 4, 4, "kv") * 1e3)
    conv_pool = nan_pool((num_slots, x.shape[1], 3), torch.float16)
    state_pool = nan_pool((num_slots, 2, 4, 4), torch.float16)
    export_checkpoints(tensor(x), conv_pool, cu, ccu, offsets, slots, recurrent_checkpoints=source,
                       recurrent_state_pool=state_pool, state_layout="vk", source_layout="kv")
    zeros = np.zeros((cu.size - 1, x.shape[1], 3), np.float32)
    want_conv = torch.as_tensor(conv_windows(x, cu, ccu, offsets, 4, zeros)).to(torch.float16)
    assert torch.equal(conv_pool.cpu()[slots[:num_real]], want_conv)
    assert torch.equal(state_pool.cpu()[slots[:num_real]], source.cpu()[:num_real].transpose(-1, -2).half())


def test_slot_offsets_past_2_31_elements():
    rng = np.random.default_rng(901)
    width, dim, heads, k, v = 4, 4, 2, 4, 4
    page = 2**30 + 64  # fits int32, so only 64-bit address arithmetic reaches slot 2 (2^31 + 128 elements in)
    try:
        storage = torch.empty(3 * page, dtype=torch.float16, device=DEVICE)  # untouched pages cost no memory
    except RuntimeError as error:
        pytest.skip(f"cannot reserve 6 GiB of address space here: {error}")
    conv_pool = storage.as_strided((3, dim, width - 1), (page, 1, dim))
    state_pool = storage.as_strided((3, heads, k, v), (page, k * v, v, 1), dim * (width - 1))
    region = storage.as_strided((3, 256), (page, 1))
    region.fill_(float("nan"))
    x = rng.standard_normal((20, dim)).astype(np.float16)
    source = rng.standard_normal((1, heads, k, v)).astype(np.float16)
    export_checkpoints(tensor(x, torch.float16), conv_pool, [0, 20], [0, 1], [9], [2],
                       recurrent_checkpoints=tensor(source, torch.float16), recurrent_state_pool=state_pool)
    got = region.cpu().numpy()
    np.testing.assert_array_equal(got[2, :dim * (width - 1)].reshape(width - 1, dim), x[6:9])
    np.testing.assert_array_equal(got[2, dim * (width - 1):dim * (width - 1) + heads * k * v], source.reshape(-1))
    assert np.isnan(got[:2]).all() and np.isnan(got[2, dim * (width - 1) + heads * k * v:]).all()


def test_nothing_declined_or_padded_is_written():
    rng = np.random.default_rng(1001)
    x = tensor(rng.standard_normal((12, 3)))
    pool = nan_pool((4, 3, 3))
    export_checkpoints(x, pool, [0, 12], [0, 1], [6, 0, 0], [NULL_SLOT, 2, 3])
    export_checkpoints(x, pool, [0, 12], [0, 0], [0, 0], [1, 2])
    export_checkpoints(x, pool, [0, 12], [0, 0], [], [])
    assert torch.isnan(pool).all()


def good_args(rng):
    x = tensor(rng.standard_normal((30, 4)))
    kwargs = dict(conv_state_pool=nan_pool((8, 4, 3)), cu_seqlens=np.array([0, 10, 30], np.int32),
                  checkpoint_cu=np.array([0, 1, 3], np.int32), checkpoint_offsets=np.array([4, 8, 16, 0], np.int32),
                  checkpoint_state_indices=np.array([1, 2, 3, 0], np.int32),
                  recurrent_checkpoints=tensor(rng.standard_normal((4, 2, 3, 5))),
                  recurrent_state_pool=nan_pool((8, 2, 3, 5)))
    return x, kwargs


BAD_INPUTS = [
    ("x", lambda x, a: (x.double(), a)),
    ("x", lambda x, a: (x[:, None], a)),
    ("conv_state_pool", lambda x, a: (x, {**a, "conv_state_pool": torch.zeros(8, 4, 3, dtype=torch.int32)})),
    ("conv_state_pool", lambda x, a: (x, {**a, "conv_state_pool": nan_pool((8, 5, 3))})),
    ("conv_state_pool", lambda x, a: (x, {**a, "conv_state_pool": torch.empty(8, 4, 3, device="meta")})),
    ("conv_state_pool", lambda x, a: (x, {**a, "conv_state_pool": nan_pool((8, 4, 1)).expand(8, 4, 3)})),
    ("conv_width", lambda x, a: (x, {**a, "conv_width": 5})),
    ("cu_seqlens", lambda x, a: (x, {**a, "cu_seqlens": np.array([0, 10, 31])})),
    ("checkpoint_offsets", lambda x, a: (x, {**a, "checkpoint_offsets": np.array([10, 8, 16, 0])})),
    ("checkpoint_offsets", lambda x, a: (x, {**a, "checkpoint_offsets": np.array([4, 16, 8, 0])})),
    ("checkpoint_offsets", lambda x, a: (x, {**a, "checkpoint_offsets": np.array([4, 8, 16, 3])})),
    ("checkpoint_offsets", lambda x, a: (x, {**a, "alignment": 4, "checkpoint_offsets": np.array([4, 6, 16, 0])})),
    ("checkpoint_cu", lambda x, a: (x, {**a, "checkpoint_cu": np.array([0, 1])})),
    ("checkpoint_state_indices", lambda x, a: (x, {**a, "checkpoint_state_indices": np.array([1, 8, 3, 0])})),
    ("checkpoint_state_indices", lambda x, a: (x, {**a, "checkpoint_state_indices": np.array([1, -2, 3, 0])})),
    ("checkpoint_state_indices", lambda x, a: (x, {**a, "checkpoint_state_indices": np.array([1, 3, 3, 0])})),
    ("checkpoint_state_indices", lambda x, a: (x, {**a, "checkpoint_state_indices": np.array([1, 2, 3])})),
    ("checkpoint_state_indices", lambda x, a: (x, {**a, "initial_conv_states": nan_pool((8, 4, 3)),
                                                   "initial_state_indices": np.array([5, 3])})),
    ("initial_conv_states", lambda x, a: (x, {**a, "initial_conv_states": nan_pool((3, 4, 3))})),
    ("initial_conv_states", lambda x, a: (x, {**a, "has_initial_state": np.array([True, False])})),
    ("initial_state_indices", lambda x, a: (x, {**a, "initial_conv_states": nan_pool((8, 4, 3)),
                                                "initial_state_indices": np.array([5, 8])})),
    ("has_initial_state", lambda x, a: (x, {**a, "initial_conv_states": nan_pool((2, 4, 3)),
                                            "has_initial_state": np.array([1, 0])})),
    ("recurrent_checkpoints", lambda x, a: (x, {**a, "recurrent_state_pool": None})),
    ("recurrent_checkpoints", lambda x, a: (x, {**a, "recurrent_state_pool": nan_pool((8, 2, 5, 3))})),
    ("recurrent_checkpoints", lambda x, a: (x, {**a, "recurrent_checkpoints": a["recurrent_checkpoints"][:3]})),
    ("recurrent_state_pool", lambda x, a: (x, {**a, "recurrent_state_pool": nan_pool((7, 2, 3, 5))})),
    ("recurrent_row_ids", lambda x, a: (x, {**a, "recurrent_row_ids": np.array([0, 1, 4, 0])})),
    ("state_layout", lambda x, a: (x, {**a, "state_layout": "hkv"})),
    ("alignment", lambda x, a: (x, {**a, "alignment": 0})),
]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
def test_bad_input_raises_before_anything_is_written(case):
    name, mutate = BAD_INPUTS[case]
    x, kwargs = mutate(*good_args(np.random.default_rng(1100 + case)))
    with pytest.raises(ValueError, match=f"^{name}"):
        export_checkpoints(x, **kwargs)
    for key in ("conv_state_pool", "recurrent_state_pool"):
        pool = kwargs.get(key)
        if pool is not None and pool.device.type != "meta" and pool.dtype.is_floating_point:
            assert torch.isnan(pool).all()


def test_good_args_do_write():
    x, kwargs = good_args(np.random.default_rng(1099))
    export_checkpoints(x, **kwargs, alignment=4)
    assert not torch.isnan(kwargs["conv_state_pool"][1:4]).any()
    assert torch.isnan(kwargs["conv_state_pool"][[0, 4, 5, 6, 7]]).all()


@pytest.mark.gpu
def test_bfloat16_pools_round_like_torch():
    rng = np.random.default_rng(1201)
    x, cu, ccu, offsets = batch(rng)
    num_real, num_slots = int(ccu[-1]), offsets.size + 2
    slots = slots_for(rng, ccu, offsets.size, num_slots, declined=0)
    xb = tensor(x, torch.bfloat16)
    source = tensor(states_like(rng, offsets.size, 4, 16, 16, "kv"))
    conv_pool = nan_pool((num_slots, x.shape[1], 3), torch.bfloat16)
    state_pool = nan_pool((num_slots, 4, 16, 16), torch.bfloat16)
    export_checkpoints(xb, conv_pool, cu, ccu, offsets, slots, recurrent_checkpoints=source,
                       recurrent_state_pool=state_pool, state_layout="vk")
    zeros = np.zeros((cu.size - 1, x.shape[1], 3), np.float32)
    want_conv = conv_windows(xb.float().cpu().numpy(), cu, ccu, offsets, 4, zeros)
    assert torch.equal(conv_pool.float().cpu()[slots[:num_real]], torch.as_tensor(want_conv))
    assert torch.equal(state_pool[slots[:num_real]], source[:num_real].transpose(-1, -2).to(torch.bfloat16))
