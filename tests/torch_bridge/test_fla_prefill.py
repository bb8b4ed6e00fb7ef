"""The launch logic of the FLA prefill drivers, with a float64 torch recurrence in FLA's call signature as the kernel.

The fake kernel checks what FLA requires of a call (B = 1, int64 cu_seqlens, fp32 initial states, one per row) and
records every launch; results are compared with jaxckpt's float64 references. The real FLA paths are in
tests/gpu/test_torch_bridge_gpu.py.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxckpt.ops.delta_rule.reference import gated_delta_rule as gdn_reference  # noqa: E402
from jaxckpt.ops.delta_rule.reference import kda as kda_reference  # noqa: E402
from jaxckpt.plan.conventions import NULL_SLOT, PAD_CHECKPOINT_OFFSET  # noqa: E402
from tests.numerics import rel_rms  # noqa: E402
from tests.torch_bridge.helpers import assert_each_raises, check_outputs, two_row_paged_options  # noqa: E402
from torch_bridge.ops.fla_prefill import (  # noqa
    chunk_gated_delta_rule_split,
    chunk_gated_delta_rule_split_paged,
    chunk_kda_native,
    chunk_kda_native_paged,
    chunk_kda_split,
    chunk_kda_split_paged,
    split_prefill,
)

BOUND = 1e-6


class FakeFLA:
    """chunk_gated_delta_rule / chunk_kda in float64, token by token; `calls` records each launch's cu_seqlens,
    `keywords` the keywords of each launch. The model options follow FLA 0.6.0's definitions (l2norm with eps 1e-6
    inside the sqrt; KDA's fused gate from A_log, dt_bias, lower_bound)."""

    def __init__(self):
        self.calls = []
        self.keywords = []

    def __call__(self, *args, **keywords):
        self.keywords.append(keywords)
        return self._run(*args, **keywords)

    def _run(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, lower_bound=None,
             return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, A_log=None,
             dt_bias=None):
        assert q.ndim == 4 and q.shape[0] == 1
        assert cu_seqlens.dtype == torch.int64 and torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
        assert initial_state.dtype == torch.float32 and initial_state.shape[0] == cu_seqlens.numel() - 1
        assert output_final_state
        assert not return_intermediate_states or torch.is_inference_mode_enabled()
        self.calls.append(cu_seqlens_cpu.tolist())
        out_dtype = q.dtype
        q, k, v, g, beta = (t[0].double() for t in (q, k, v, g, beta))
        if use_qk_l2norm_in_kernel:
            q, k = (t / (t * t).sum(-1, keepdim=True).add(1e-6).sqrt() for t in (q, k))
        if use_gate_in_kernel:
            x = g + (0 if dt_bias is None else dt_bias.double().reshape(g.shape[1:]))
            rate = 1 if A_log is None else A_log.double().exp()[:, None]
            g = -rate * torch.nn.functional.softplus(x) if lower_bound is None else lower_bound * torch.sigmoid(
                rate * x)
        num_v_heads = v.shape[1]
        group = num_v_heads // q.shape[1]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        states = initial_state.double()
        if state_v_first:
            states = states.transpose(-1, -2)
        o = torch.zeros(v.shape, dtype=torch.float64)
        finals, chunk_states = [], []
        bounds = cu_seqlens_cpu.tolist()
        for n in range(len(bounds) - 1):
            state = states[n].clone()  # [HV, K, V]
            for t in range(bounds[n], bounds[n + 1]):
                if (t - bounds[n]) % 64 == 0:
                    chunk_states.append(state.clone())
                decay = g[t].exp()
                state = state * (decay[:, :, None] if decay.ndim == 2 else decay[:, None, None])
                kt = k[t].repeat_interleave(group, 0)  # [HV, K]
                u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, kt))
                state = state + kt[:, :, None] * u[:, None, :]
                o[t] = torch.einsum("hkv,hk->hv", state, scale * q[t].repeat_interleave(group, 0))
            finals.append(state)
        final = torch.stack(finals).float()
        if state_v_first:
            final = final.transpose(-1, -2).contiguous()
        out = (o[None].to(out_dtype), final)
        if return_intermediate_states:
            h = torch.stack(chunk_states)
            if state_v_first:
                h = h.transpose(-1, -2)
            return (*out, h[None].to(torch.bfloat16))
        return out


def problem(rng, lengths, *, heads=2, v_heads=4, dim=8, per_channel=False, pad=2):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    num_tokens = int(cu[-1]) + pad
    q = rng.standard_normal((num_tokens, heads, dim))
    k = rng.standard_normal((num_tokens, heads, dim))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g_shape = (num_tokens, v_heads, dim) if per_channel else (num_tokens, v_heads)
    arrays = dict(q=q, k=k, v=rng.standard_normal((num_tokens, v_heads, dim)),
                  g=-np.abs(rng.standard_normal(g_shape)) * 0.2, beta=rng.uniform(0.1, 0.9, (num_tokens, v_heads)),
                  initial_state=rng.standard_normal((len(lengths), v_heads, dim, dim)) * 0.3)
    return {name: a.astype(np.float32) for name, a in arrays.items()}, cu


def torch_args(arrays):
    return {name: torch.tensor(a) for name, a in arrays.items()}


def test_gdn_split_runs_k_plus_one_launches_for_the_whole_batch():
    rng = np.random.default_rng(401)
    arrays, cu = problem(rng, [9, 0, 1, 20, 6, 5])
    # per-row counts 2, 0, 0, 3, 1, 0: three launches whatever the batch size; offsets 1 and len - 1 included
    ccu = np.array([0, 2, 2, 2, 5, 6, 6], np.int32)
    offsets = np.array([1, 8, 3, 4, 19, 5, PAD_CHECKPOINT_OFFSET], np.int32)
    fake = FakeFLA()
    options = dict(cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets)
    out = chunk_gated_delta_rule_split(**torch_args(arrays), kernel=fake, **options)
    check_outputs(out, gdn_reference(**arrays, **options), cu, ccu, bound=BOUND)
    assert len(fake.calls) == 4
    # launch 0: the first segment of every non-empty row; the length-1 row and unsplit rows finish there
    assert fake.calls[0] == [0, 1, 2, 5, 10, 15]
    assert fake.calls[1] == [0, 7, 8, 9]
    assert fake.calls[2] == [0, 1, 16]
    assert fake.calls[3] == [0, 1]
    assert torch.equal(out[1][1], torch.tensor(arrays["initial_state"][1]))


def test_kda_split_vk_layout_and_batched_form():
    rng = np.random.default_rng(402)
    arrays, cu = problem(rng, [30, 12], per_channel=True, pad=0)
    arrays["initial_state"] = np.swapaxes(arrays["initial_state"], -1, -2).copy()
    ccu, offsets = np.array([0, 2, 3], np.int32), np.array([5, 29, 11], np.int32)
    options = dict(cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets, state_layout="vk")
    args = torch_args(arrays)
    for name in ("q", "k", "v", "g", "beta"):
        args[name] = args[name][None]  # FLA's [1, T, ...]
    fake = FakeFLA()
    out = chunk_kda_split(**args, kernel=fake, **options)
    assert out[0].shape == (1, 42, 4, 8) and out[1].shape == (2, 4, 8, 8)
    check_outputs((out[0][0], *out[1:]), kda_reference(**arrays, **options), cu, ccu, bound=BOUND)
    assert len(fake.calls) == 3


def test_kda_native_reads_intermediate_states_in_one_launch():
    rng = np.random.default_rng(403)
    arrays, cu = problem(rng, [130, 0, 64, 200], per_channel=True)
    ccu = np.array([0, 2, 2, 2, 4], np.int32)
    offsets = np.array([64, 128, 64, 192, PAD_CHECKPOINT_OFFSET], np.int32)
    options = dict(cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets)
    fake = FakeFLA()
    o, final, ckpt = chunk_kda_native(**torch_args(arrays), kernel=fake, **options)
    expected = kda_reference(**arrays, **options)
    assert len(fake.calls) == 1
    assert rel_rms(o[:int(cu[-1])], expected[0][:int(cu[-1])]) <= BOUND
    assert rel_rms(final, expected[1]) <= BOUND
    assert torch.equal(final[1], torch.tensor(arrays["initial_state"][1]))
    # the states are FLA's bf16 ones: equal to the float64 state rounded to bf16, up to one rounding step
    for m in range(4):
        rounded = torch.tensor(expected[2][m]).to(torch.bfloat16).double().numpy()
        assert rel_rms(ckpt[m], rounded) <= 1e-2 * 2 ** -8, m
        assert 0 < rel_rms(ckpt[m], expected[2][m]) <= 2 ** -8
    assert torch.count_nonzero(ckpt[4]) == 0
    assert ckpt.dtype == torch.float32


def test_kda_native_refuses_offsets_off_the_64_grid_before_any_launch():
    rng = np.random.default_rng(404)
    arrays, cu = problem(rng, [130, 70], per_channel=True)
    fake = FakeFLA()
    pool = torch.full((4, 4, 8, 8), float("nan"))
    for offsets in ([64, 65], [100, 64]):
        with pytest.raises(ValueError, match="^checkpoint_offsets: offset .* multiple of the alignment 64"):
            chunk_kda_native(**torch_args(arrays), kernel=fake, cu_seqlens=cu,
                             checkpoint_cu=np.array([0, 1, 2]), checkpoint_offsets=np.array(offsets))
        with pytest.raises(ValueError, match="^checkpoint_offsets"):
            chunk_kda_native_paged(**{k: v for k, v in torch_args(arrays).items() if k != "initial_state"},
                                   state_pool=pool, kernel=fake, cu_seqlens=cu, checkpoint_cu=np.array([0, 1, 2]),
                                   checkpoint_offsets=np.array(offsets), initial_state_indices=[1, 2],
                                   has_initial_state=np.array([True, True]), final_state_indices=[1, 2],
                                   checkpoint_state_indices=[3, NULL_SLOT])
    assert fake.calls == [] and torch.isnan(pool).all()


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_paged_split_writes_only_named_slots(pool_dtype):
    rng = np.random.default_rng(405 + (pool_dtype == torch.bfloat16))
    arrays, cu = problem(rng, [12, 7, 3])
    pool = torch.full((9, 4, 8, 8), float("nan"), dtype=pool_dtype)
    pool[2] = torch.tensor(arrays["initial_state"][0]).to(pool_dtype)
    pool[6] = torch.tensor(arrays["initial_state"][2]).to(pool_dtype)
    ccu = np.array([0, 2, 3, 3], np.int32)
    offsets = np.array([4, 11, 6, PAD_CHECKPOINT_OFFSET], np.int32)
    slots = dict(initial_state_indices=np.array([2, -1, 6]), has_initial_state=np.array([True, True, True]),
                 final_state_indices=np.array([2, 5, -1]), checkpoint_state_indices=np.array([7, NULL_SLOT, 8, 4]))
    h0 = np.stack([pool[2].float().numpy(), np.zeros_like(arrays["initial_state"][1]), pool[6].float().numpy()])
    fake = FakeFLA()
    options = dict(cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets)
    args = torch_args({k: v for k, v in arrays.items() if k != "initial_state"})
    o = chunk_gated_delta_rule_split_paged(**args, state_pool=pool, kernel=fake, **slots, **options)
    expected = gdn_reference(**{**arrays, "initial_state": h0}, **options)
    bound = BOUND if pool_dtype == torch.float32 else 2 ** -8
    assert rel_rms(o[:int(cu[-1])], expected[0][:int(cu[-1])]) <= BOUND
    for slot, state in ((2, expected[1][0]), (5, expected[1][1]), (7, expected[2][0]), (8, expected[2][2])):
        assert pool[slot].dtype == pool_dtype and rel_rms(pool[slot], state) <= bound, slot
    assert torch.isnan(pool[[0, 1, 3, 4]].float()).all()
    assert torch.equal(pool[6], torch.tensor(arrays["initial_state"][2]).to(pool_dtype))


def test_bad_input_raises_before_any_launch_or_write():
    rng = np.random.default_rng(407)
    arrays, cu = problem(rng, [10, 6])
    args = torch_args({k: v for k, v in arrays.items() if k != "initial_state"})
    pool = torch.full((4, 4, 8, 8), float("nan"))
    base = two_row_paged_options(cu)
    bad = [
        ("k", dict(k=args["k"].half())),
        ("v", dict(v=args["v"][:, :3])),
        ("g", dict(g=args["g"].to("meta"))),
        ("beta", dict(beta=args["beta"][:, :1])),
        ("q", dict(q=args["q"][None].expand(2, -1, -1, -1))),
        ("checkpoint_offsets", dict(checkpoint_offsets=np.array([10]))),
        ("checkpoint_cu", dict(checkpoint_cu=np.array([0, 1]))),
        ("initial_state_indices", dict(initial_state_indices=[1, 9])),
        ("checkpoint_state_indices", dict(checkpoint_state_indices=[-3])),
        ("final_state_indices/checkpoint_state_indices", dict(checkpoint_state_indices=[1])),
        ("has_initial_state", dict(has_initial_state=[1, 0])),
        ("state_pool", dict(state_pool=pool.double())),
        ("state_layout", dict(state_layout="vv")),
    ]
    fake = FakeFLA()
    assert_each_raises(chunk_gated_delta_rule_split_paged, bad, **args, state_pool=pool, **base, kernel=fake)
    with pytest.raises(ValueError, match="^initial_state: dtype must be float32"):
        chunk_gated_delta_rule_split(**args, initial_state=torch.tensor(arrays["initial_state"]).double(),
                                     cu_seqlens=cu, kernel=fake)
    assert fake.calls == [] and torch.isnan(pool).all()


def gate_parameters(rng, *, v_heads=4, dim=8):
    """KDA gate parameters: A_log [HV] and the flat dt_bias [HV * K] of vLLM's storage, as numpy and torch."""
    arrays = dict(A_log=rng.uniform(-1.0, 0.5, v_heads).astype(np.float32),
                  dt_bias=rng.uniform(-0.5, 0.5, v_heads * dim).astype(np.float32))
    return arrays, torch_args(arrays)


@pytest.mark.parametrize("gate", ["softplus", "bounded", "bounded_without_A_log"])
def test_kda_model_options_reach_fla_under_its_names(gate):
    rng = np.random.default_rng(408)
    arrays, cu = problem(rng, [130, 0, 70], per_channel=True)
    arrays["g"] = rng.standard_normal(arrays["g"].shape).astype(np.float32)  # the raw gate input
    parameters, tensors = gate_parameters(rng)
    if gate == "bounded_without_A_log":
        del parameters["A_log"], tensors["A_log"]
    lower_bound = None if gate == "softplus" else -3.0
    ccu, offsets = np.array([0, 2, 2, 3], np.int32), np.array([64, 128, 64], np.int32)
    meta = dict(cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets)
    expected = kda_reference(**arrays, **parameters, use_qk_l2norm=True, lower_bound=lower_bound, **meta)
    for entry in (chunk_kda_split, chunk_kda_native):
        fake = FakeFLA()
        out = entry(**torch_args(arrays), **tensors, use_qk_l2norm=True, lower_bound=lower_bound, kernel=fake, **meta)
        bound = BOUND if entry is chunk_kda_split else 2 ** -8  # native checkpoints are FLA's bf16 states
        check_outputs(out, expected, cu, ccu, bound=bound)
        assert len(fake.keywords) == (3 if entry is chunk_kda_split else 1)
        for keywords in fake.keywords:
            assert keywords["use_qk_l2norm_in_kernel"] is True and keywords["use_gate_in_kernel"] is True
            assert keywords["lower_bound"] == lower_bound
            assert keywords["A_log"] is tensors.get("A_log") and keywords["dt_bias"] is tensors["dt_bias"]


def test_gdn_use_qk_l2norm_is_the_only_model_keyword_fla_gets():
    rng = np.random.default_rng(409)
    arrays, cu = problem(rng, [9, 20])
    arrays["k"] *= 3  # unnormalized, so the l2norm matters
    ccu, offsets = np.array([0, 1, 2], np.int32), np.array([4, 11], np.int32)
    meta = dict(cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets)
    for use_qk_l2norm in (False, True):
        fake = FakeFLA()
        out = chunk_gated_delta_rule_split(**torch_args(arrays), use_qk_l2norm=use_qk_l2norm, kernel=fake, **meta)
        check_outputs(out, gdn_reference(**arrays, use_qk_l2norm=use_qk_l2norm, **meta), cu, ccu, bound=BOUND)
        for keywords in fake.keywords:
            assert set(keywords) == {"scale", "initial_state", "output_final_state", "cu_seqlens", "cu_seqlens_cpu",
                                     "use_qk_l2norm_in_kernel"}
            assert keywords["use_qk_l2norm_in_kernel"] is use_qk_l2norm


def test_fla_names_and_other_unknown_keywords_raise_type_error_before_any_launch():
    rng = np.random.default_rng(410)
    arrays, cu = problem(rng, [10, 6], per_channel=True)
    _, tensors = gate_parameters(rng)
    gdn_arrays, _ = problem(rng, [10, 6])
    fake = FakeFLA()
    unknown = [(chunk_kda_split, arrays, dict(use_qk_l2norm_in_kernel=True)),
               (chunk_kda_native, arrays, dict(chunk_size=32)),
               (chunk_kda_split, arrays, dict(use_gate_in_kernel=True, **tensors)),
               (chunk_kda_split, arrays, dict(safe_gate=True)),
               (chunk_gated_delta_rule_split, gdn_arrays, dict(A_log=tensors["A_log"])),
               (chunk_gated_delta_rule_split, gdn_arrays, dict(kernel_options={}))]
    for entry, problem_arrays, keywords in unknown:
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            entry(**torch_args(problem_arrays), cu_seqlens=cu, kernel=fake, **keywords)
    pool = torch.full((4, 4, 8, 8), float("nan"))
    paged = {k: v for k, v in torch_args(arrays).items() if k != "initial_state"}
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        chunk_kda_split_paged(**paged, state_pool=pool, **two_row_paged_options(cu), kernel=fake,
                              use_qk_l2norm_in_kernel=True)
    assert fake.calls == [] and torch.isnan(pool).all()


def test_bad_model_options_raise_before_any_launch_or_write():
    rng = np.random.default_rng(411)
    arrays, cu = problem(rng, [10, 6], per_channel=True)
    _, tensors = gate_parameters(rng)
    args = torch_args({k: v for k, v in arrays.items() if k != "initial_state"})
    pool = torch.full((4, 4, 8, 8), float("nan"))
    bad = [
        ("A_log", dict(A_log=tensors["A_log"][:3])),
        ("A_log", dict(A_log=tensors["A_log"].double())),
        ("A_log", dict(A_log=arrays["q"][0, 0, :4])),
        ("dt_bias", dict(dt_bias=tensors["dt_bias"])),  # no A_log or lower_bound: nothing would use it
        ("dt_bias", dict(A_log=tensors["A_log"], dt_bias=tensors["dt_bias"][:8])),
        ("lower_bound", dict(lower_bound=-6.0)),
        ("lower_bound", dict(lower_bound=0.0)),
        ("lower_bound", dict(lower_bound=True)),
    ]
    fake = FakeFLA()
    assert_each_raises(chunk_kda_split_paged, bad, **args, state_pool=pool, **two_row_paged_options(cu), kernel=fake)
    assert_each_raises(chunk_kda_native_paged, bad, **args, state_pool=pool, **two_row_paged_options(cu), kernel=fake)
    gdn_arrays, _ = problem(rng, [10, 6])
    with pytest.raises(ValueError, match="^lower_bound: the fused gate is KDA's"):
        split_prefill(fake, **torch_args(gdn_arrays), per_channel=False, cu_seqlens=cu, lower_bound=-1.0)
    assert fake.calls == [] and torch.isnan(pool).all()
