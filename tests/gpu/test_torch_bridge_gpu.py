"""torch_bridge's kernels on a GPU: FLA split / native checkpoints, the Triton SSD and the DLPack bridge, bf16
against jaxckpt's float64 references at the bf16 class (rel-RMS 6e-3).

Run on the GPU machine (fla-core 0.6.0 installed, JAX with CUDA):
`JAXCKPT_GPU_TESTS=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -q -s
tests/gpu/test_torch_bridge_gpu.py` (`-s` shows the measured errors).
"""

import numpy as np
import pytest

from tests.numerics import rel_rms

pytestmark = pytest.mark.gpu

BF16_BOUND = 6e-3
FP32_BOUND = 1e-5


def check_errors(label, out, expected, *, bound):
    """rel-RMS of (outputs, final states, each checkpoint state) against the reference's, printed (`-s`) and bounded."""
    errors = [rel_rms(out[0], expected[0]), rel_rms(out[1], expected[1])]
    errors += [rel_rms(out[2][m], expected[2][m]) for m in range(len(expected[2]))]
    print(f"\n{label} rel-RMS: outputs {errors[0]:.2e}, final {errors[1]:.2e}, checkpoints "
          f"{', '.join(f'{e:.2e}' for e in errors[2:])}")
    assert max(errors) <= bound


def delta_problem(op, *, lengths=(700, 1, 299, 130), heads=2, v_heads=4, dim=128, seed=42):
    import torch

    rng = np.random.default_rng(seed)
    T = sum(lengths)
    q = rng.standard_normal((T, heads, dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k = rng.standard_normal((T, heads, dim)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((T, v_heads, dim)).astype(np.float32)
    g = -np.log1p(np.exp(-rng.standard_normal((T, v_heads) if op == "gdn" else (T, v_heads, dim)))).astype(np.float32)
    if op == "kda":
        g /= 8
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, v_heads))))).astype(np.float32)
    h0 = (rng.standard_normal((len(lengths), v_heads, dim, dim)) * 0.1).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    bf = [torch.tensor(a, device="cuda").to(torch.bfloat16) for a in (q, k, v)]
    exact = [t.float().cpu().numpy() for t in bf]  # the reference sees exactly the bf16 inputs
    tensors = dict(q=bf[0], k=bf[1], v=bf[2], g=torch.tensor(g, device="cuda"), beta=torch.tensor(beta, device="cuda"))
    return tensors, dict(q=exact[0], k=exact[1], v=exact[2], g=g, beta=beta), h0, cu


def reference(op):
    from jaxckpt.ops.delta_rule.reference import gated_delta_rule, kda

    return gated_delta_rule if op == "gdn" else kda


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_fla_split_against_float64(op):
    import torch

    from torch_bridge.ops.fla_prefill import chunk_gated_delta_rule_split, chunk_kda_split

    tensors, arrays, h0, cu = delta_problem(op)
    meta = dict(cu_seqlens=cu, checkpoint_cu=np.array([0, 3, 3, 4, 5]),
                checkpoint_offsets=np.array([1, 64, 511, 298, 129]))
    fn = chunk_gated_delta_rule_split if op == "gdn" else chunk_kda_split
    out = fn(**tensors, initial_state=torch.tensor(h0, device="cuda"), **meta)
    check_errors(f"{op} FLA split", out, reference(op)(**arrays, initial_state=h0, **meta), bound=BF16_BOUND)


def test_fla_kda_native_against_float64_and_bf16_state_error():
    import torch

    from torch_bridge.ops.fla_prefill import chunk_kda_native, chunk_kda_split

    tensors, arrays, h0, cu = delta_problem("kda")
    meta = dict(cu_seqlens=cu, checkpoint_cu=np.array([0, 3, 3, 4, 5]),
                checkpoint_offsets=np.array([64, 128, 640, 256, 64]))
    initial = torch.tensor(h0, device="cuda")
    o, final, native = chunk_kda_native(**tensors, initial_state=initial, **meta)
    _, _, split = chunk_kda_split(**tensors, initial_state=initial, **meta)
    expected = reference("kda")(**arrays, initial_state=h0, **meta)
    assert rel_rms(o, expected[0]) <= BF16_BOUND and rel_rms(final, expected[1]) <= BF16_BOUND
    native_errors = [rel_rms(native[m], expected[2][m]) for m in range(5)]
    split_errors = [rel_rms(split[m], expected[2][m]) for m in range(5)]
    print(f"\nKDA checkpoint rel-RMS vs float64: native bf16 h {', '.join(f'{e:.2e}' for e in native_errors)}; "
          f"split fp32 final states {', '.join(f'{e:.2e}' for e in split_errors)}")
    assert max(native_errors) <= BF16_BOUND and max(split_errors) <= BF16_BOUND
    with pytest.raises(ValueError, match="^checkpoint_offsets"):
        chunk_kda_native(**tensors, initial_state=initial, **{**meta, "checkpoint_offsets": np.array([64, 100, 640,
                                                                                                         256, 64])})


@pytest.mark.parametrize("op, lower_bound", [("gdn", None), ("kda", None), ("kda", -3.0)])
def test_fla_model_options_against_float64(op, lower_bound):
    """use_qk_l2norm and KDA's fused gate (A_log, dt_bias, lower_bound) reach FLA under its names: the split (and
    KDA's native) results match jaxckpt's float64 reference computing the same options."""
    import torch

    from torch_bridge.ops.fla_prefill import chunk_gated_delta_rule_split, chunk_kda_native, chunk_kda_split

    tensors, arrays, h0, cu = delta_problem(op)
    for name in ("q", "k"):  # off the unit sphere (x2 is exact in bf16), so the in-kernel l2norm matters
        tensors[name], arrays[name] = tensors[name] * 2, arrays[name] * 2
    options, parameters = dict(use_qk_l2norm=True), {}
    if op == "kda":
        rng = np.random.default_rng(43)
        arrays["g"] = rng.standard_normal(arrays["g"].shape).astype(np.float32)  # the raw gate input
        tensors["g"] = torch.tensor(arrays["g"], device="cuda")
        parameters = dict(A_log=rng.uniform(-1.0, 0.5, 4).astype(np.float32),
                          dt_bias=rng.uniform(-0.5, 0.5, 4 * 128).astype(np.float32))
        options["lower_bound"] = lower_bound
    meta = dict(cu_seqlens=cu, checkpoint_cu=np.array([0, 3, 3, 4, 5]),
                checkpoint_offsets=np.array([64, 128, 640, 256, 64]))
    expected = reference(op)(**arrays, initial_state=h0, **parameters, **options, **meta)
    entries = [chunk_gated_delta_rule_split] if op == "gdn" else [chunk_kda_split, chunk_kda_native]
    for entry in entries:
        out = entry(**tensors, initial_state=torch.tensor(h0, device="cuda"), **options, **meta,
                    **{name: torch.tensor(a, device="cuda") for name, a in parameters.items()})
        check_errors(f"{op} {entry.__name__} {options}", out, expected, bound=BF16_BOUND)


def test_fla_split_paged_bf16_pool():
    import torch

    from torch_bridge.ops.fla_prefill import chunk_gated_delta_rule_split_paged

    tensors, arrays, h0, cu = delta_problem("gdn", lengths=(300, 90))
    pool = torch.full((8, 4, 128, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    pool[2] = torch.tensor(h0[0], device="cuda").to(torch.bfloat16)
    meta = dict(cu_seqlens=cu, checkpoint_cu=np.array([0, 1, 2]), checkpoint_offsets=np.array([200, 1]))
    chunk_gated_delta_rule_split_paged(**tensors, state_pool=pool, initial_state_indices=[2, -1],
                                       has_initial_state=np.array([True, False]), final_state_indices=[2, 3],
                                       checkpoint_state_indices=[4, 5], **meta)
    h0_used = np.stack([torch.tensor(h0[0]).to(torch.bfloat16).float().numpy(), np.zeros_like(h0[1])])
    expected = reference("gdn")(**arrays, initial_state=h0_used, **meta)
    for slot, state in ((2, expected[1][0]), (3, expected[1][1]), (4, expected[2][0]), (5, expected[2][1])):
        assert rel_rms(pool[slot], state) <= BF16_BOUND, slot
    assert torch.isnan(pool[[0, 1, 6, 7]].float()).all()


def _torch_args(case):
    import ml_dtypes
    import torch

    metadata = ("cu_seqlens", "checkpoint_cu", "checkpoint_offsets")
    args = {}
    for name, a in case.inputs.items():
        if name in metadata:
            args[name] = a
        elif a.dtype == np.dtype(ml_dtypes.bfloat16):
            args[name] = torch.from_numpy(np.array(a).view(np.int16)).view(torch.bfloat16).cuda()
        else:
            args[name] = torch.tensor(np.array(a), device="cuda")
    options = dict(case.options)
    if options.get("dt_limit") is not None:
        options["dt_limit"] = tuple(options["dt_limit"])
    return args, options


def test_triton_ssd_shared_vectors():
    from tests.vectors.loader import check_case, load_cases
    from torch_bridge.ops.ssd import ssd

    for case in load_cases("ssd"):
        args, options = _torch_args(case)
        check_case(case, ssd(**args, **options))


def test_triton_ssd_real_head_size_bf16_against_float64():
    import torch

    from jaxckpt.ops.ssd.reference import ssd as ssd_reference
    from torch_bridge.ops.ssd import ssd

    rng = np.random.default_rng(7)
    lengths, H, P, G, N = [1500, 1, 400, 130], 8, 64, 2, 128
    T = sum(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    bf = lambda a: torch.tensor(a.astype(np.float32), device="cuda").to(torch.bfloat16)  # noqa: E731
    x, z = bf(rng.standard_normal((T, H, P))), bf(rng.standard_normal((T, H, P)))
    B, C = bf(rng.standard_normal((T, G, N))), bf(rng.standard_normal((T, G, N)))
    dt = bf(rng.standard_normal((T, H)) - 2)
    A = -np.exp(rng.uniform(0, 2, H)).astype(np.float32)
    D = rng.standard_normal(H).astype(np.float32)
    dt_bias = (rng.standard_normal(H) * 0.5).astype(np.float32)
    h0 = (rng.standard_normal((4, H, P, N)) * 0.1).astype(np.float32)
    meta = dict(cu_seqlens=cu, checkpoint_cu=np.array([0, 3, 3, 5, 5]),
                checkpoint_offsets=np.array([1, 777, 1499, 64, 399]))
    cuda = lambda a: torch.tensor(a, device="cuda")  # noqa: E731
    for precision, bound in (("ieee", BF16_BOUND), ("tf32", BF16_BOUND)):
        out = ssd(x, dt, cuda(A), B, C, D=cuda(D), dt_bias=cuda(dt_bias), z=z, initial_state=cuda(h0),
                  dot_precision=precision, **meta)
        f32 = lambda t: t.float().cpu().numpy()  # noqa: E731
        expected = ssd_reference(f32(x), f32(dt), A, f32(B), f32(C), D=D, dt_bias=dt_bias, z=f32(z), initial_state=h0,
                                 **meta)
        check_errors(f"Triton SSD bf16 ({precision})", out, expected, bound=bound)


def test_bridge_paged_gdn_on_gpu_equals_jaxckpt_paged():
    import jax
    import jax.numpy as jnp
    import torch

    from jaxckpt import ops
    from jaxckpt.plan.conventions import map_vllm_slots
    from torch_bridge import interop

    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here (JAX_PLATFORMS=cuda)")
    tensors, arrays, h0, cu = delta_problem("gdn", lengths=(300, 90, 40))
    pool = np.full((8, 4, 128, 128), np.nan, np.float32)
    pool[2], pool[5] = h0[0], h0[2]
    slots = dict(initial_state_indices=np.array([2, -1, 5]), has_initial_state=np.array([True, False, True]),
                 final_state_indices=np.array([2, 3, -1]), checkpoint_state_indices=np.array([4, 6]))
    meta = dict(cu_seqlens=cu, checkpoint_cu=np.array([0, 1, 2, 2]), checkpoint_offsets=np.array([100, 7]),
                implementation="xla")
    torch_pool = torch.tensor(pool, device="cuda").to(torch.bfloat16)
    o = interop.gated_delta_rule_paged(*tensors.values(), torch_pool, **slots, **meta)
    jax_slots = {name: (value if name == "has_initial_state" else map_vllm_slots(value))
                 for name, value in slots.items()}
    jax_o, jax_pool = ops.gated_delta_rule_paged(
        *(interop.to_jax(t) for t in tensors.values()), jnp.asarray(pool, jnp.bfloat16), **jax_slots, donate=False,
        **meta)
    assert o.device.type == "cuda"
    assert rel_rms(o, np.asarray(jax_o.astype(jnp.float32))) <= 1e-6
    # the same XLA computation on the same inputs; NaN (untouched) slots must coincide
    np.testing.assert_allclose(torch_pool.float().cpu().numpy(), np.asarray(jax_pool.astype(jnp.float32)), rtol=1e-2,
                               atol=1e-3)
