"""Differentiation through the public op entries.

The XLA path (and `implementation=None`, which takes it on the CPU) differentiates: its gradient of a scalar loss
matches central differences of the float64 reference along random directions, decode rows, checkpoints, padding and
paged pools included. Every other implementation raises a ValueError naming implementation="xla" when jax.grad,
jax.vjp, jax.jvp or jax.linearize reaches it, while its forward, traced or not, stays as it was.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt import ops
from jaxckpt.ops.common.api import choose_implementation
from jaxckpt.ops.conv1d.api import REGISTRY as CONV1D_REGISTRY
from jaxckpt.ops.delta_rule.api import GDN_REGISTRY, KDA_REGISTRY
from jaxckpt.ops.ssd.api import REGISTRY as SSD_REGISTRY

CU = np.array([0, 1, 14, 30], np.int32)          # one decode row, two prefill rows, 2 padding tokens
T = 32
CKPT_CU = np.array([0, 0, 1, 3], np.int32)
OFFSETS = np.array([5, 4, 11, 0], np.int32)      # one padded entry
META = dict(cu_seqlens=CU, checkpoint_cu=CKPT_CU, checkpoint_offsets=OFFSETS)
PAGED = dict(initial_state_indices=np.array([1, 2, 0], np.int32), has_initial_state=np.array([True, True, False]),
             final_state_indices=np.array([3, 1, 4], np.int32),
             checkpoint_state_indices=np.array([5, 6, 2, 0], np.int32))
SLOTS = 7
NOT_DIFFERENTIABLE = 'is not differentiable .* pass implementation="xla"'


def _delta(rng, *, per_channel):
    H, HV, K, V = 1, 2, 16, 16
    k = rng.standard_normal((T, H, K))
    return dict(q=rng.standard_normal((T, H, K)), k=k / np.linalg.norm(k, axis=-1, keepdims=True),
                v=rng.standard_normal((T, HV, V)),
                g=np.log(rng.uniform(0.5, 1.0, (T, HV, K) if per_channel else (T, HV))),
                beta=rng.uniform(0.1, 0.9, (T, HV))), (HV, K, V)


def _ssd(rng):
    H, G, P, N = 2, 1, 16, 16
    return dict(x=rng.standard_normal((T, H, P)), dt=rng.standard_normal((T, H)) - 1, A=-rng.uniform(0.5, 2.0, H),
                B=rng.standard_normal((T, G, N)), C=rng.standard_normal((T, G, N)), D=rng.standard_normal(H)), \
        (H, P, N)


def _conv(rng):
    D, W = 6, 4
    return dict(x=rng.standard_normal((T, D)), weight=rng.standard_normal((D, W)), bias=rng.standard_normal(D)), \
        (D, W - 1)


def case(op, rng):
    """(inputs by name, state shape, entry(paged, implementation, **inputs) -> outputs)."""
    if op in ("gdn", "kda"):
        arrays, shape = _delta(rng, per_channel=op == "kda")
        plain, paged = ((ops.gated_delta_rule, ops.gated_delta_rule_paged) if op == "gdn"
                        else (ops.kda, ops.kda_paged))
        options = dict(use_qk_l2norm=True, chunk_size=16)
        positional = ("q", "k", "v", "g", "beta")
    elif op == "ssd":
        arrays, shape = _ssd(rng)
        plain, paged, options, positional = ops.ssd, ops.ssd_paged, dict(chunk_size=16), ("x", "dt", "A", "B", "C")
    else:
        arrays, shape = _conv(rng)
        plain, paged, options, positional = ops.causal_conv1d, ops.causal_conv1d_paged, {}, ("x", "weight")
    decodes = {} if op == "conv1d" else dict(num_decodes=1)

    def entry(is_paged, implementation, **inputs):
        args = [inputs.pop(name) for name in positional]
        extra = dict(options, **(decodes if implementation != "reference" else {}), **inputs)
        if is_paged:
            pool = extra.pop("state_pool")
            if op == "conv1d":  # the pool comes before bias here
                return paged(*args, pool, extra.pop("bias"), **extra, **META, **PAGED,
                             implementation=implementation)
            return paged(*args, pool, **extra, **META, **PAGED, implementation=implementation)
        return plain(*args, **extra, **META, implementation=implementation)

    return arrays, shape, entry


def _loss(outputs, weights, xp):
    return sum(xp.sum(xp.asarray(o, xp.float64 if xp is np else jnp.float32) * w)
               for o, w in zip(outputs, weights))


def _central_difference(f, x, direction, eps):
    """d/dt f(x + t direction) at 0, Richardson-extrapolated central differences (error O(eps^4))."""
    d = [(f(x + h * direction) - f(x - h * direction)) / (2 * h) for h in (eps, eps / 2)]
    return (4 * d[1] - d[0]) / 3


# the paged forms share run_paged (gather, run, scatter) whatever the op: GDN for the delta rules and SSD, conv1d for
# its own argument order; each op's plain entry covers its XLA gradient (every case compiles for seconds on the CPU).
# GDN's plain entry is called as the layers call it, implementation=None: the XLA path on the CPU
@pytest.mark.parametrize("op, paged, implementation", [
    ("gdn", False, None), ("kda", False, "xla"), ("ssd", False, "xla"), ("conv1d", False, "xla"),
    ("gdn", True, "xla"), ("conv1d", True, "xla")])
def test_xla_gradient_matches_central_differences_of_the_reference(op, paged, implementation):
    rng = np.random.default_rng(["gdn", "kda", "ssd", "conv1d"].index(op) * 2 + paged)
    arrays, shape, entry = case(op, rng)
    if paged:
        arrays["state_pool"] = rng.standard_normal((SLOTS, *shape))
    else:
        arrays["initial_state"] = rng.standard_normal((CU.size - 1, *shape))
    out_shapes = [np.shape(o) for o in entry(paged, "reference", **arrays)]
    weights = [rng.standard_normal(s) for s in out_shapes]
    weights[0][CU[-1]:] = 0  # padding tokens' outputs are zeros by contract, not part of the op's function
    names = sorted(arrays)

    def loss(*values):
        return _loss(entry(paged, implementation, **dict(zip(names, values))),
                     [jnp.asarray(w, jnp.float32) for w in weights], jnp)

    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))(
        *(jnp.asarray(arrays[n], jnp.float32) for n in names))
    # the paged reference writes its states into the fp32 pool: rounding there, so a larger step and tolerance
    eps, tol = (2e-2, 2e-4) if paged else (1e-3, 2e-5)
    for name, grad in zip(names, grads):
        direction = rng.standard_normal(arrays[name].shape)
        want = _central_difference(lambda x: _loss(entry(paged, "reference", **{**arrays, name: x}), weights, np),
                                   arrays[name], direction, eps)
        got = float(np.sum(np.asarray(grad, np.float64) * direction))
        assert abs(got - want) <= tol * abs(want), (name, got, want)

REGISTRIES = {"gdn": GDN_REGISTRY, "kda": KDA_REGISTRY, "ssd": SSD_REGISTRY, "conv1d": CONV1D_REGISTRY}


@pytest.mark.parametrize("op", ["gdn", "kda", "ssd", "conv1d"])
def test_the_default_call_on_the_cpu_is_the_differentiable_xla_path(op):
    # the layers call with implementation=None; on the CPU every Pallas backend declines and the XLA path runs
    arrays, _, _ = case(op, np.random.default_rng(11))
    names = {"gdn": ("q", "k", "v", "g", "beta"), "ssd": ("x", "dt", "B", "C"), "conv1d": ("x",)}
    call = {name: arrays[name] for name in names.get(op, names["gdn"])}
    choice = choose_implementation(REGISTRIES[op], None, **call,
                                   **({} if op == "conv1d" else {"chunk_size": 16}))
    assert choice.name == "xla" and choice.differentiable


def _transforms(f, x):
    """Each of the four transforms of f at x, as thunks."""
    return {"grad": lambda: jax.grad(lambda y: jnp.sum(f(y)))(x), "vjp": lambda: jax.vjp(f, x),
            "jvp": lambda: jax.jvp(f, (x,), (jnp.ones_like(x),)), "linearize": lambda: jax.linearize(f, x)}


INTERPRET_TRITON = ops.DeltaPallasTritonConfig(interpret=True)
PIECES = ops.SequenceParallelConfig(base="pallas_triton", interpret=True, piece_len=16)
NON_DIFFERENTIABLE = [
    ("gdn", False, "pallas_triton", INTERPRET_TRITON),
    ("kda", False, "pallas_triton", INTERPRET_TRITON),
    ("ssd", False, "pallas_triton", ops.SsdPallasTritonConfig(interpret=True)),
    ("gdn", True, "pallas_triton", INTERPRET_TRITON),
    ("kda", True, "pallas_triton", INTERPRET_TRITON),
    ("ssd", True, "pallas_triton", ops.SsdPallasTritonConfig(interpret=True)),
    ("gdn", False, "sequence_parallel", PIECES),
    ("kda", True, "sequence_parallel", PIECES),
    ("gdn", False, "reference", None),
    ("ssd", True, "reference", None),
    ("conv1d", False, "reference", None),
]


@pytest.mark.parametrize("op, paged, implementation, config", NON_DIFFERENTIABLE)
def test_other_implementations_raise_naming_xla(op, paged, implementation, config):
    rng = np.random.default_rng(5)
    arrays, shape, entry = case(op, rng)
    arrays = {name: jnp.asarray(a, jnp.float32) for name, a in arrays.items()}
    if paged:
        arrays["state_pool"] = jnp.asarray(rng.standard_normal((SLOTS, *shape)), jnp.float32)
    if config is not None:
        arrays["config"] = config
    first = next(iter(arrays))

    def f(x):
        return entry(paged, implementation, **{**arrays, first: x})[0]

    for transform in _transforms(f, arrays[first]).values():
        with pytest.raises(ValueError, match=f"^implementation: '{implementation}' {NOT_DIFFERENTIABLE}"):
            transform()


@pytest.mark.parametrize("op", ["gdn", "kda", "ssd"])
def test_mosaic_gpu_raises_naming_xla(op):
    # its wgmma tiles take 16-bit operands and head dims of 64 or 128; interpret=True supports the call on the CPU
    rng = np.random.default_rng(9)
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    config = (ops.SsdPallasMosaicGpuConfig if op == "ssd" else ops.DeltaPallasMosaicGpuConfig)(interpret=True)
    options = dict(implementation="pallas_mosaic_gpu", config=config)
    if op == "ssd":
        dt, A, B = jnp.asarray(rng.standard_normal((64, 2)), jnp.float32), -jnp.ones(2), bf16(64, 1, 64)
        x, f = bf16(64, 2, 64), lambda x: ops.ssd(x, dt, A, B, B, **options)[0]
    else:
        g = -jnp.asarray(rng.uniform(0.01, 0.5, (64, 1) if op == "gdn" else (64, 1, 64)), jnp.float32)
        k, v, beta = bf16(64, 1, 64), bf16(64, 1, 64), jnp.full((64, 1), 0.5, jnp.float32)
        entry = ops.gated_delta_rule if op == "gdn" else ops.kda
        x, f = bf16(64, 1, 64), lambda q: entry(q, k, v, g, beta, use_qk_l2norm=True, **options)[0]
    for transform in _transforms(lambda y: f(y).astype(jnp.float32), x).values():
        with pytest.raises(ValueError, match=f"^implementation: 'pallas_mosaic_gpu' {NOT_DIFFERENTIABLE}"):
            transform()


def test_the_error_names_the_default_choice(monkeypatch):
    # the Pallas Triton path supports the call as on a GPU; the derivative rule raises while tracing, before any
    # kernel would run
    from jaxckpt.ops.delta_rule import pallas_triton

    monkeypatch.setattr(pallas_triton, "supports", lambda *args, **kwargs: None)
    arrays, _, entry = case("gdn", np.random.default_rng(6))
    arrays = {name: jnp.asarray(a, jnp.float32) for name, a in arrays.items()}

    def f(q):
        return entry(False, None, **{**arrays, "q": q})[0]

    with pytest.raises(ValueError, match=f"^implementation: None picked 'pallas_triton', which {NOT_DIFFERENTIABLE}"):
        jax.grad(lambda q: jnp.sum(f(q)))(arrays["q"])


def test_the_error_names_the_config_that_picked():
    arrays, _, entry = case("gdn", np.random.default_rng(8))
    arrays = {name: jnp.asarray(a, jnp.float32) for name, a in arrays.items()}

    def f(q):
        return entry(False, None, **{**arrays, "q": q}, config=INTERPRET_TRITON)[0]

    with pytest.raises(ValueError, match=f"^implementation: the DeltaPallasTritonConfig picked 'pallas_triton', which "
                                         f"{NOT_DIFFERENTIABLE} with an XlaConfig or no config"):
        jax.grad(lambda q: jnp.sum(f(q)))(arrays["q"])


def test_the_forward_is_unchanged_and_runs_where_no_tangent_reaches_it():
    from jaxckpt.ops.ssd import pallas_triton

    arrays, _, _ = case("ssd", np.random.default_rng(7))
    x, dt, A, B, C, D = (jnp.asarray(arrays[name], jnp.float32) for name in ("x", "dt", "A", "B", "C", "D"))

    def entry(x, cu_seqlens):  # traced x: the kernel call goes through the custom_jvp wrapper
        return ops.ssd(x, dt, A, B, C, D=D, cu_seqlens=cu_seqlens, chunk_size=16,
                       config=ops.SsdPallasTritonConfig(interpret=True))[:2]

    def kernel(x):  # the kernel module itself, never wrapped
        return pallas_triton.ssd(x, dt, A, B, C, D=D, cu_seqlens=CU, chunk_size=16, interpret=True)[:2]

    for a, b in zip(jax.jit(entry)(x, CU), jax.jit(kernel)(x)):
        np.testing.assert_array_equal(a, b)
    # traced integer metadata passes through the wrapper, and a call that no tangent reaches runs its forward
    cu = jnp.asarray(CU)
    scaled = jax.jit(jax.grad(lambda s, x, cu: s * jnp.sum(entry(jax.lax.stop_gradient(x), cu)[0])))(
        jnp.float32(1), x, cu)
    np.testing.assert_allclose(scaled, jnp.sum(jax.jit(kernel)(x)[0]), rtol=1e-6)
    with pytest.raises(ValueError, match=NOT_DIFFERENTIABLE):
        jax.jit(jax.grad(lambda x, cu: jnp.sum(entry(x, cu)[0])))(x, cu)


def test_sequence_parallel_differentiates_with_the_xla_base_only():
    arrays, _, _ = case("gdn", np.random.default_rng(8))
    call = {name: arrays[name].astype(np.float32) for name in ("q", "k", "v", "g", "beta")}
    choice = lambda **options: choose_implementation(GDN_REGISTRY, "sequence_parallel", chunk_size=16, **call,
                                                     **options)
    assert choice(base="xla").differentiable
    assert not choice(base="xla", correction="pallas", interpret=True).differentiable
    assert not choice(base="pallas_triton", interpret=True).differentiable
    assert choose_implementation(GDN_REGISTRY, "xla", **call).differentiable
    assert not choose_implementation(GDN_REGISTRY, "pallas_triton", interpret=True, **call).differentiable
