"""jaxckpt's implementations on a GPU: the shared vectors per their classes, and real head sizes against float64.

Run on the GPU machine: `JAXCKPT_GPU_TESTS=1 JAX_PLATFORMS=cuda python -m pytest -q tests/gpu`.
"""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

IMPLEMENTATIONS = {"gdn": ("xla", "pallas_triton"), "kda": ("xla", "pallas_triton"),
                   "ssd": ("xla", "pallas_triton", "pallas_mosaic_gpu"),
                   "conv1d": ("xla",)}


def _cases():
    from tests.vectors.loader import load_cases

    return [(op, impl, case) for op, impls in IMPLEMENTATIONS.items() for case in load_cases(op) for impl in impls]


SUPPORT_ARGUMENTS = {"gdn": ("q", "k", "v", "g", "beta"), "kda": ("q", "k", "v", "g", "beta"),
                     "ssd": ("x", "dt", "B", "C")}


def _declined(op, impl, case) -> str | None:
    """The kernel's own reason for not running this case (e.g. SSD vectors' P = 8 is below a Triton tile)."""
    if impl == "xla":
        return None
    import importlib

    from jaxckpt.ops.delta_rule.api import MODULES

    module = MODULES[impl] if op in ("gdn", "kda") else f"jaxckpt.ops.{op}.{impl}"
    supports = importlib.import_module(module).supports
    return supports(*(case.arguments[name] for name in SUPPORT_ARGUMENTS[op]))


@pytest.mark.parametrize("op, impl, case", _cases(), ids=lambda x: getattr(x, "name", x))
def test_vectors_on_gpu(op, impl, case):
    from jaxckpt import ops
    from tests.vectors.loader import check_case

    reason = _declined(op, impl, case)
    if reason is not None:
        pytest.skip(f"{impl} declines this case: {reason}")
    entry = {"gdn": ops.gated_delta_rule, "kda": ops.kda, "ssd": ops.ssd, "conv1d": ops.causal_conv1d}[op]
    outputs = entry(**case.arguments, implementation=impl)
    check_case(case, [np.asarray(o) for o in outputs])


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize("impl", ["xla", "pallas_triton"])
def test_real_head_size_bf16_against_float64(op, impl):
    import jax.numpy as jnp

    from jaxckpt import ops
    from jaxckpt.ops.delta_rule.reference import gated_delta_rule as gdn_ref
    from jaxckpt.ops.delta_rule.reference import kda as kda_ref

    rng = np.random.default_rng(42)
    lengths, H, D = [700, 1, 299], 2, 128
    T = sum(lengths)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k = rng.standard_normal((T, H, D)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((T, 2 * H, D)).astype(np.float32)
    g = -np.log1p(np.exp(-rng.standard_normal((T, 2 * H) if op == "gdn" else (T, 2 * H, D)))).astype(np.float32)
    if op == "kda":
        g /= 8
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, 2 * H))))).astype(np.float32)
    h0 = (rng.standard_normal((3, 2 * H, D, D)) * 0.1).astype(np.float32)
    bf = [np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)) for a in (q, k, v)]
    meta = dict(cu_seqlens=np.array([0, 700, 701, 1000]), checkpoint_cu=np.array([0, 3, 3, 4]),
                checkpoint_offsets=np.array([1, 64, 512, 298]), initial_state=h0)
    reference = gdn_ref if op == "gdn" else kda_ref
    expected = reference(*bf, g, beta, **meta)
    fn = ops.gated_delta_rule if op == "gdn" else ops.kda
    got = fn(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), g, beta, **meta, implementation=impl)
    for name, a, b in zip(("o", "final", "checkpoints"), got, expected):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        print(f"{op} {impl} {name} rel-RMS {err:.2e}")
        assert err < 6e-3, (name, err)


@pytest.mark.parametrize("impl", ["xla", "pallas_triton", "pallas_mosaic_gpu"])
def test_ssd_real_head_size_bf16_against_float64(impl):
    import jax.numpy as jnp

    from jaxckpt import ops
    from jaxckpt.ops.ssd.reference import ssd as ssd_ref

    rng = np.random.default_rng(7)
    lengths, H, G, P, N = [700, 1, 299], 8, 2, 64, 128
    T = sum(lengths)
    x = rng.standard_normal((T, H, P)).astype(np.float32)
    dt = rng.standard_normal((T, H)).astype(np.float32) - 1
    A = -np.exp(rng.standard_normal(H)).astype(np.float32)
    B = (rng.standard_normal((T, G, N)) / np.sqrt(N)).astype(np.float32)
    C = (rng.standard_normal((T, G, N)) / np.sqrt(N)).astype(np.float32)
    h0 = (rng.standard_normal((3, H, P, N)) * 0.1).astype(np.float32)
    bf = [np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)) for a in (x, B, C)]
    meta = dict(cu_seqlens=np.array([0, 700, 701, 1000]), checkpoint_cu=np.array([0, 3, 3, 4]),
                checkpoint_offsets=np.array([1, 64, 512, 298]), initial_state=h0)
    expected = ssd_ref(bf[0], dt, A, bf[1], bf[2], **meta)
    got = ops.ssd(*(jnp.asarray(a, jnp.bfloat16) for a in (x,)), dt, A,
                  *(jnp.asarray(a, jnp.bfloat16) for a in (B, C)), **meta, implementation=impl)
    for name, a, b in zip(("y", "final", "checkpoints"), got, expected):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        print(f"ssd {impl} {name} rel-RMS {err:.2e}")
        assert err < 6e-3, (name, err)
