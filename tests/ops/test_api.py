"""The public op entries: implementation switch, batched inputs, strategies, decode rows, paged pools, bad input."""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxckpt import ops
from jaxckpt.ops.common import api as common_api
from jaxckpt.ops.common.api import choose_implementation
from jaxckpt.ops.delta_rule.api import GDN_REGISTRY
from jaxckpt.plan import NULL_SLOT


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def delta_inputs(rng, T, H=2, HV=4, K=8, V=8, per_channel=False):
    q = rng.standard_normal((T, H, K)).astype(np.float32)
    k = rng.standard_normal((T, H, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((T, HV, V)).astype(np.float32)
    g = np.log(rng.uniform(0.3, 1.0, (T, HV, K) if per_channel else (T, HV))).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (T, HV)).astype(np.float32)
    return q, k, v, g, beta


def ssd_inputs(rng, T, H=4, G=2, P=4, N=8):
    x = rng.standard_normal((T, H, P)).astype(np.float32)
    dt = rng.standard_normal((T, H)).astype(np.float32) - 1
    A = -rng.uniform(0.5, 2.0, H).astype(np.float32)
    B = rng.standard_normal((T, G, N)).astype(np.float32)
    C = rng.standard_normal((T, G, N)).astype(np.float32)
    return x, dt, A, B, C


CU = np.array([0, 1, 2, 21, 60], np.int32)          # two decode rows, then two prefill rows
CKPT_CU = np.array([0, 0, 0, 2, 4], np.int32)
OFFSETS = np.array([1, 18, 7, 38, 0, 0], np.int32)  # two padded entries


@pytest.mark.parametrize("op", ["gdn", "kda", "ssd"])
@pytest.mark.parametrize("method", ["in_chunk", "forced_break", "split"])
def test_strategies_and_decode_rows_match_the_reference(op, method):
    rng = np.random.default_rng(abs(hash((op, method))) % 2**32)
    T = int(CU[-1])
    if op == "ssd":
        x, dt, A, B, C = ssd_inputs(rng, T)
        h0 = rng.standard_normal((4, 4, 4, 8)).astype(np.float32)

        def call(**kw):
            return ops.ssd(x, dt, A, B, C, D=np.ones(4, np.float32), initial_state=h0, cu_seqlens=CU,
                           checkpoint_cu=CKPT_CU, checkpoint_offsets=OFFSETS, **kw)
    else:
        fn = ops.gated_delta_rule if op == "gdn" else ops.kda
        args = delta_inputs(rng, T, per_channel=op == "kda")
        h0 = rng.standard_normal((4, 4, 8, 8)).astype(np.float32)

        def call(**kw):
            return fn(*args, initial_state=h0, cu_seqlens=CU, checkpoint_cu=CKPT_CU, checkpoint_offsets=OFFSETS,
                      **kw)
    expected = call(implementation="reference")
    got = call(implementation="xla", checkpoint_method=method, num_decodes=2, chunk_size=16)
    assert got[2].shape[0] == OFFSETS.size
    for a, b in zip(got[:2], expected[:2]):
        assert rel(a, b) < 1e-5
    assert rel(got[2][:4], expected[2][:4]) < 1e-5


@pytest.mark.interpret
def test_kernels_decline_forced_break_rather_than_run_in_chunk():
    q, k, v, g, beta = delta_inputs(np.random.default_rng(2), 10, K=16, V=16)
    call = dict(q=q, k=k, v=v, g=g, beta=beta, chunk_size=16, interpret=True)
    needs = {"checkpoint_method": "forced_break"}
    registry = {name: GDN_REGISTRY[name] for name in ("pallas_triton", "xla")}
    assert choose_implementation(registry, None, **call).name == "pallas_triton"
    choice = choose_implementation(registry, None, needs=needs, **call)
    assert choice.name == "xla" and "checkpoint_method" in dict(choice.declined)["pallas_triton"]
    with pytest.raises(ValueError, match="does not support this call: checkpoint_method: 'forced_break'"):
        ops.gated_delta_rule(q, k, v, g, beta, implementation="pallas_triton", checkpoint_method="forced_break",
                             chunk_size=16, config=ops.DeltaPallasTritonConfig(interpret=True))
    # the reference has no chunks: every method is its own exact answer
    ops.gated_delta_rule(q, k, v, g, beta, implementation="reference", checkpoint_method="forced_break")


def test_default_implementation_falls_back_to_xla_with_reasons():
    q, k, v, g, beta = delta_inputs(np.random.default_rng(1), 10)
    choice = choose_implementation(GDN_REGISTRY, None, q=q, k=k, v=v, g=g, beta=beta, state_layout="kv",
                                   chunk_size=64)
    assert choice.name == "xla"
    assert [name for name, _ in choice.declined] == ["pallas_mosaic_gpu", "pallas_triton"]
    with pytest.raises(ValueError, match="implementation"):
        ops.gated_delta_rule(q, k, v, g, beta, implementation="cuda")


def test_a_config_runs_the_implementation_it_tunes():
    q, k, v, g, beta = delta_inputs(np.random.default_rng(11), 10, K=16, V=16)
    sequential = ops.gated_delta_rule(q, k, v, g, beta, chunk_size=16, config=ops.XlaConfig(state_pass="sequential"))
    associative = ops.gated_delta_rule(q, k, v, g, beta, chunk_size=16, implementation="xla")
    for a, b in zip(sequential, associative):
        assert rel(a, b) < 1e-5
    triton = ops.gated_delta_rule(q, k, v, g, beta, chunk_size=16, config=ops.DeltaPallasTritonConfig(
        interpret=True, block_v=16, fuse_output=True))
    for a, b in zip(triton, associative):
        assert rel(a, b) < 1e-5
    # named by its config, an implementation that declines raises instead of falling back to another
    with pytest.raises(ValueError, match="implementation: 'pallas_mosaic_gpu' does not support this call"):
        ops.gated_delta_rule(q, k, v, g, beta, config=ops.DeltaPallasMosaicGpuConfig(pieces=2))


@pytest.mark.parametrize("config, implementation, match", [
    (ops.DeltaPallasTritonConfig(), "xla", "config: a DeltaPallasTritonConfig tunes 'pallas_triton', but "
                                           "implementation='xla'"),
    (ops.SsdPallasTritonConfig(), None, "config: a SsdPallasTritonConfig tunes none of this op's implementations"),
    ({"interpret": True}, None, "config: a dict tunes none"),
    (ops.XlaConfig(), "reference", "config: a XlaConfig tunes 'xla', but implementation='reference'"),
])
def test_a_config_for_another_implementation_raises(config, implementation, match):
    q, k, v, g, beta = delta_inputs(np.random.default_rng(12), 10)
    with pytest.raises(ValueError, match=match):
        ops.gated_delta_rule(q, k, v, g, beta, implementation=implementation, config=config)


@pytest.mark.parametrize("build, match", [
    (lambda: ops.XlaConfig(state_pass="parallel"), "state_pass: must be one of"),
    (lambda: ops.DeltaPallasTritonConfig(block_v=48), "block_v: must be a power of two in"),
    (lambda: ops.DeltaPallasTritonConfig(num_warps=True), "num_warps: must be a power of two"),
    (lambda: ops.DeltaPallasTritonConfig(fuse_output=1), "fuse_output: must be a bool"),
    (lambda: ops.DeltaPallasMosaicGpuConfig(pieces=0), "pieces: must be an int in \\[1, 64\\] or 'auto'"),
    (lambda: ops.DeltaPallasMosaicGpuConfig(state_terms=True), "state_terms: must be one of"),
    (lambda: ops.DeltaPallasMosaicGpuConfig(state="v1"), "state: must be one of"),
    (lambda: ops.DeltaPallasMosaicGpuConfig(state="fused", intra_inverse="f16"), "state: 'fused' replaces"),
    (lambda: ops.SsdPallasMosaicGpuConfig(stages=5), "stages: must be one of"),
    (lambda: ops.SequenceParallelConfig(base="xla", base_config=ops.DeltaPallasTritonConfig()), "base_config: a "),
    (lambda: ops.SequenceParallelConfig(piece_cuts="even"), "piece_cuts: must be one of"),
    (lambda: ops.SequenceParallelConfig(base_config=ops.DeltaPallasTritonConfig(interpret=True)), "base_config: set "
                                                                                                    "interpret"),
    (lambda: ops.DeltaPallasMosaicGpuConfig(interpret=1), "interpret: must be a bool or a plgpu.InterpretGPUParams"),
    (lambda: ops.SsdPallasMosaicGpuConfig(interpret=[True]), "interpret: must be a bool or a plgpu.InterpretGPUParams"),
])
def test_a_config_checks_its_fields_when_built(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_configs_are_frozen_and_hashable():
    config = ops.DeltaPallasMosaicGpuConfig(pieces=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.pieces = 2
    assert hash(config) == hash(ops.DeltaPallasMosaicGpuConfig(pieces=4))
    with pytest.raises(TypeError):
        ops.DeltaPallasTritonConfig(checkpoint_pass="after")  # a variant that left: no such field


def test_a_sequence_parallel_config_passes_its_base_config_on():
    config = ops.SequenceParallelConfig(base_config=ops.XlaConfig(state_pass="sequential"), piece_len=32)
    assert config.options() == dict(base="xla", state_pass="sequential", piece_len=32, piece_cuts="checkpoints",
                                    compose="associative", interpret=False)
    # interpret is set once, on the outer config, and reaches the Pallas base
    pallas = ops.SequenceParallelConfig(interpret=True, base_config=ops.DeltaPallasTritonConfig(fuse_output=True))
    assert pallas.options()["interpret"] is True and pallas.options()["base"] == "pallas_triton"


def test_a_mosaic_gpu_config_takes_the_interpreters_settings():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    config = ops.DeltaPallasMosaicGpuConfig(interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert hash(config) == hash(ops.DeltaPallasMosaicGpuConfig(interpret=plgpu.InterpretGPUParams(detect_races=True)))


def test_a_kda_only_option_on_a_gdn_call_raises():
    q, k, v, g, beta = delta_inputs(np.random.default_rng(13), 10, K=16, V=16)
    with pytest.raises(ValueError, match="kda_block_k tunes KDA's intra pass; this is a GDN call"):
        ops.gated_delta_rule(q, k, v, g, beta, chunk_size=16,
                             config=ops.DeltaPallasTritonConfig(interpret=True, kda_block_k=16))


def test_supports_gets_cu_seqlens_where_it_names_it(monkeypatch):
    # the Mosaic GPU launch grids depend on the row count; other `supports` take the call as before
    seen = {}

    def sized(q, *, cu_seqlens=None):
        seen["sized"] = cu_seqlens
        return "grid too large"

    def plain(q, **tuning):
        seen["plain"] = tuning

    modules = {"sized": SimpleNamespace(supports=sized), "plain": SimpleNamespace(supports=plain)}
    monkeypatch.setattr(common_api, "_load", lambda target: (modules[target], target))
    cu = np.array([0, 3, 10], np.int32)
    choice = choose_implementation({"pallas_mosaic_gpu": "sized", "xla": "plain"}, None, cu_seqlens=cu, q=None)
    assert choice.name == "xla" and choice.declined == (("pallas_mosaic_gpu", "grid too large"),)
    assert seen["sized"] is cu and seen["plain"] == {}


def test_batched_inputs_are_rows_of_equal_length():
    rng = np.random.default_rng(2)
    q, k, v, g, beta = delta_inputs(rng, 2 * 20)
    batched = [a.reshape(2, 20, *a.shape[1:]) for a in (q, k, v, g, beta)]
    o_b, f_b, _ = ops.gated_delta_rule(*batched)
    o_p, f_p, c_p = ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens=np.array([0, 20, 40]))
    assert o_b.shape == (2, 20, 4, 8) and c_p.shape == (0, 4, 8, 8)
    np.testing.assert_array_equal(np.asarray(o_b).reshape(40, 4, 8), o_p)
    np.testing.assert_array_equal(f_b, f_p)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.gated_delta_rule(*batched, cu_seqlens=np.array([0, 40]))


@pytest.mark.parametrize("op", ["gdn", "ssd"])
def test_prefill_then_token_by_token_decode_equals_one_long_prefill(op):
    rng = np.random.default_rng(3)
    T, prefix = 40, 33
    if op == "gdn":
        arrays = delta_inputs(rng, T)
        fn, kwargs = ops.gated_delta_rule, {}
    else:
        x, dt, A, B, C = ssd_inputs(rng, T)
        arrays = (x, dt, B, C)
        fn = lambda x, dt, B, C, **kw: ops.ssd(x, dt, A, B, C, **kw)  # noqa: E731
        kwargs = {}
    full_out, full_final, _ = fn(*arrays, **kwargs)
    out, state, _ = fn(*(a[:prefix] for a in arrays), **kwargs)
    outs = [np.asarray(out)]
    for t in range(prefix, T):
        step_out, state, _ = fn(*(a[t:t + 1] for a in arrays), initial_state=state, cu_seqlens=np.array([0, 1]),
                                num_decodes=1, **kwargs)
        outs.append(np.asarray(step_out))
    assert rel(np.concatenate(outs), full_out) < 1e-5
    assert rel(state, full_final) < 1e-5


def test_traced_metadata_compiles_once():
    rng = np.random.default_rng(4)
    q, k, v, g, beta = delta_inputs(rng, 48)
    traces = []

    @jax.jit
    def f(cu, ccu, offsets):
        traces.append(1)
        return ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets,
                                    implementation="xla", chunk_size=16)

    for cu, ccu, offsets in [([0, 10, 48], [0, 1, 2], [3, 30]), ([0, 40, 48], [0, 2, 2], [16, 39])]:
        got = f(jnp.array(cu), jnp.array(ccu), jnp.array(offsets))
        expected = ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens=np.array(cu), checkpoint_cu=np.array(ccu),
                                        checkpoint_offsets=np.array(offsets), implementation="reference")
        for a, b in zip(got, expected):
            assert rel(a, b) < 1e-5
    assert len(traces) == 1


@pytest.mark.parametrize("pool_dtype", [np.float32, ml_dtypes.bfloat16])
def test_paged_pool_writes_only_final_and_checkpoint_slots(pool_dtype):
    rng = np.random.default_rng(5)
    q, k, v, g, beta = delta_inputs(rng, int(CU[-1]))
    pool = np.full((12, 4, 8, 8), np.nan, np.float32)
    stale = rng.standard_normal((4, 8, 8)).astype(np.float32)
    pool[3], pool[4], pool[5] = rng.standard_normal((3, 4, 8, 8))
    pool[6] = stale                                          # a fresh row's slot holds stale data
    initial = np.array([3, 4, 5, 6])
    has_initial = np.array([True, True, True, False])
    final_slots = np.array([7, 8, 9, 10])
    ckpt_slots = np.array([1, 2, 11, NULL_SLOT, NULL_SLOT, NULL_SLOT])
    ckpt_cu = np.array([0, 0, 0, 2, 3], np.int32)
    offsets = np.array([1, 18, 7, 0, 0, 0], np.int32)
    # the reference starts from the states as the pool holds them (rounded to bf16 in a bf16 pool)
    h0 = np.stack([pool[3], pool[4], pool[5], np.zeros_like(stale)]).astype(pool_dtype).astype(np.float32)
    o_ref, f_ref, c_ref = ops.gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=CU,
                                               checkpoint_cu=ckpt_cu, checkpoint_offsets=offsets,
                                               implementation="reference")
    o, new_pool = ops.gated_delta_rule_paged(
        q, k, v, g, beta, jnp.asarray(pool.astype(pool_dtype)), initial_state_indices=initial,
        has_initial_state=has_initial, final_state_indices=final_slots, checkpoint_state_indices=ckpt_slots,
        cu_seqlens=CU, checkpoint_cu=ckpt_cu, checkpoint_offsets=offsets, num_decodes=2, chunk_size=16)
    new_pool = np.asarray(new_pool.astype(jnp.float32))
    tol = 1e-5 if pool_dtype == np.float32 else 1e-2
    assert rel(o, o_ref) < 1e-5
    assert rel(new_pool[final_slots], f_ref) < tol
    assert rel(new_pool[[1, 2, 11]], c_ref[:3]) < tol
    assert np.isnan(new_pool[NULL_SLOT]).all()               # the null slot is never written
    untouched = [3, 4, 5, 6]
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched].astype(pool_dtype).astype(np.float32))


def test_paged_pool_bad_slots_are_refused_before_anything_runs():
    rng = np.random.default_rng(6)
    q, k, v, g, beta = delta_inputs(rng, 10)
    pool = jnp.zeros((4, 4, 8, 8))
    common = dict(initial_state_indices=[1], has_initial_state=[True], cu_seqlens=[0, 10])
    with pytest.raises(ValueError, match="final_state_indices.*outside"):
        ops.gated_delta_rule_paged(q, k, v, g, beta, pool, final_state_indices=[4], **common)
    with pytest.raises(ValueError, match="written twice"):
        ops.gated_delta_rule_paged(q, k, v, g, beta, pool, final_state_indices=[2], checkpoint_state_indices=[2],
                                   checkpoint_cu=[0, 1], checkpoint_offsets=[5], **common)
    with pytest.raises(ValueError, match="null slot"):
        ops.gated_delta_rule_paged(q, k, v, g, beta, pool, final_state_indices=[2], checkpoint_state_indices=[3, 1],
                                   checkpoint_cu=[0, 1], checkpoint_offsets=[5, 0], **common)
    with pytest.raises(ValueError, match="checkpoint_offsets.*outside"):
        ops.gated_delta_rule(q, k, v, g, beta, checkpoint_cu=[0, 1], checkpoint_offsets=[10])
    with pytest.raises(ValueError, match="num_decodes"):
        ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens=[0, 10], num_decodes=1)


def test_conv_paged_and_checkpoint_copies_are_exact():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((30, 6)).astype(np.float32)
    weight = rng.standard_normal((6, 4)).astype(np.float32)
    cu, ccu, offsets = np.array([0, 2, 30]), np.array([0, 1, 1]), np.array([1, 0, 0])
    pool = np.full((5, 6, 3), np.nan, np.float32)
    pool[1] = rng.standard_normal((6, 3))
    y, new_pool = ops.causal_conv1d_paged(
        x, weight, jnp.asarray(pool), initial_state_indices=[1, 0], has_initial_state=[True, False],
        final_state_indices=[2, 3], checkpoint_state_indices=[4, NULL_SLOT, NULL_SLOT], cu_seqlens=cu,
        checkpoint_cu=ccu, checkpoint_offsets=offsets)
    y_ref, _, _ = ops.causal_conv1d(x, weight, initial_state=np.stack([pool[1], np.zeros((6, 3), np.float32)]),
                                    cu_seqlens=cu, implementation="reference")
    assert rel(y, y_ref) < 1e-6
    new_pool = np.asarray(new_pool)
    # row 0's checkpoint at offset 1: the incoming state's last two inputs, then token 0
    np.testing.assert_array_equal(new_pool[4], np.concatenate([pool[1][:, 1:], x[0:1].T], axis=1))
    np.testing.assert_array_equal(new_pool[3], x[27:30].T)
    assert np.isnan(new_pool[NULL_SLOT]).all()


@pytest.mark.interpret
def test_pallas_triton_through_the_public_entry_in_interpret_mode():
    rng = np.random.default_rng(8)
    q, k, v, g, beta = delta_inputs(rng, 40, H=1, HV=2, K=16, V=16)
    meta = dict(cu_seqlens=np.array([0, 1, 40]), checkpoint_cu=np.array([0, 0, 1]), checkpoint_offsets=np.array([20]))
    expected = ops.gated_delta_rule(q, k, v, g, beta, **meta, implementation="reference")
    got = ops.gated_delta_rule(q, k, v, g, beta, **meta, implementation="pallas_triton", num_decodes=1, chunk_size=16,
                               config=ops.DeltaPallasTritonConfig(interpret=True))
    for a, b in zip(got, expected):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_random_batches_in_one_shape_bucket(op):
    """Seeded sweep: row lengths, decode rows, initial states and checkpoint lists vary; shapes stay fixed."""
    rng = np.random.default_rng(9 if op == "gdn" else 10)
    fn = ops.gated_delta_rule if op == "gdn" else ops.kda
    T, N, M = 72, 5, 6
    for _ in range(4):
        num_decodes = int(rng.integers(0, 3))
        lengths = [1] * num_decodes + list(rng.integers(0, 14, N - num_decodes))
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        rows = [np.sort(rng.choice(np.arange(1, n), min(int(rng.integers(0, 3)), n - 1), replace=False))
                if n > 2 and i >= num_decodes else np.zeros(0, int) for i, n in enumerate(lengths)]
        rows = [r[:max(0, M - sum(len(x) for x in rows[:i]))] for i, r in enumerate(rows)]
        ccu = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
        offsets = np.concatenate([np.concatenate(rows), np.zeros(M - ccu[-1])]).astype(np.int32)
        args = delta_inputs(rng, T, per_channel=op == "kda")
        h0 = rng.standard_normal((N, 4, 8, 8)).astype(np.float32) * (rng.random((N, 1, 1, 1)) < 0.6)
        meta = dict(initial_state=h0, cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets)
        expected = fn(*args, **meta, implementation="reference")
        got = fn(*args, **meta, implementation="xla", num_decodes=num_decodes, chunk_size=16)
        valid = int(cu[-1])
        assert rel(got[0][:valid], expected[0][:valid]) < 1e-5
        assert rel(got[1], expected[1]) < 1e-5
        assert rel(got[2][:ccu[-1]], expected[2][:ccu[-1]]) < 1e-5
