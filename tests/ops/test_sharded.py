"""Head-sharded ops on 1, 2 and 8 fake CPU devices (4 for the batched and uneven-head cases) match the single-device
public ops.

The device count is fixed when jax starts, so the checks run in one subprocess started with
`--xla_force_host_platform_device_count=8`; it prints one summary line per op that the test asserts.
"""

import os
import subprocess
import sys

SCRIPT = r"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxckpt.ops import DeltaPallasTritonConfig, causal_conv1d, gated_delta_rule, kda, ssd
from jaxckpt.ops.sharded import causal_conv1d_sharded, gated_delta_rule_sharded, kda_sharded, ssd_sharded
from jaxckpt.plan.conventions import PAD_CHECKPOINT_OFFSET

assert jax.device_count() == 8, jax.devices()
rng = np.random.default_rng(20261130)
H, HV, K, V = 8, 16, 8, 8
SSD_H, SSD_G, SSD_P, SSD_N = 8, 2, 8, 8
CONV_D, CONV_W = 16, 4
# an empty row, a single token, rows over several 16-token chunks; 3 padding tokens
lengths = [13, 0, 1, 22]
cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
T = int(cu[-1]) + 3
N = len(lengths)
# CSR checkpoints with 2 padded entries
ccu = np.array([0, 2, 2, 2, 5], np.int32)
offsets = np.array([1, 12, 5, 16, 21] + [PAD_CHECKPOINT_OFFSET] * 2, np.int32)
real = int(ccu[-1])
meta = dict(cu_seqlens=cu, checkpoint_cu=ccu, checkpoint_offsets=offsets)
# the single-device results are jitted like the sharded calls, so that both fuse alike (the conv is compared bitwise)
meshes = {n: Mesh(np.array(jax.devices()[:n]), ("heads",)) for n in (1, 2, 4, 8)}


def f32(*shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def compare(name, single, sharded_fn, *, exact=False):
    worst = 0.0
    for n in (1, 2, 8):
        got = sharded_fn(meshes[n])
        for part, a, b in zip(("out", "final", "ckpt"), got, single):
            a, b = np.asarray(a), np.asarray(b)
            if part == "out":
                a, b = a[:cu[-1]], b[:cu[-1]]
            if part == "ckpt":
                a, b = a[:real], b[:real]
            assert a.shape == b.shape, (name, n, part, a.shape, b.shape)
            if exact:
                assert np.array_equal(a, b), (name, n, part)
            else:
                err = rel(a, b)
                assert err <= 1e-6, (name, n, part, err)
                worst = max(worst, err)
        spec = got[2].sharding.spec
        assert tuple(spec)[:2] == (None, "heads") or n == 1, (name, n, spec)
    print(f"{name}: meshes 1 2 8 ok worst_rel={worst:.1e}")


q, k = f32(T, H, K), f32(T, H, K)
v, beta = f32(T, HV, V), jax.nn.sigmoid(f32(T, HV))
g = -jax.nn.softplus(f32(T, HV))
h0 = f32(N, HV, K, V, scale=0.3)
opts = dict(use_qk_l2norm=True, chunk_size=16, implementation="xla")
single = jax.jit(lambda: gated_delta_rule(q, k, v, g, beta, initial_state=h0, **meta, **opts))()
compare("gdn", single, lambda m: gated_delta_rule_sharded(m, q, k, v, g, beta, initial_state=h0, **meta, **opts))

# split launches plan on the host (metadata closed over as constants); batched rows without checkpoints give an
# empty checkpoint result built outside the map
split = dict(opts, checkpoint_method="split")
want = jax.jit(lambda: gated_delta_rule(q, k, v, g, beta, initial_state=h0, **meta, **split))()
got = gated_delta_rule_sharded(meshes[8], q, k, v, g, beta, initial_state=h0, **meta, **split)
assert all(rel(a[:cu[-1]], b[:cu[-1]]) <= 1e-6 for a, b in zip(got, want))
batched = [a[:36].reshape(2, 18, *a.shape[1:]) for a in (q, k, v, g, beta)]
want = jax.jit(lambda: gated_delta_rule(*batched, **opts))()
got = gated_delta_rule_sharded(meshes[4], *batched, **opts)
assert [a.shape for a in got] == [a.shape for a in want] and want[2].shape[0] == 0
assert rel(got[0], want[0]) <= 1e-6 and rel(got[1], want[1]) <= 1e-6
print("gdn: split and batched ok")

# the Pallas kernels (interpret mode here) run unchecked under the map: they declare no varying manual axes
pq, pk, pv = f32(T, 2, 16), f32(T, 2, 16), f32(T, 4, 16)
pg, pbeta = -jax.nn.softplus(f32(T, 4)), jax.nn.sigmoid(f32(T, 4))
popts = dict(chunk_size=16, config=DeltaPallasTritonConfig(interpret=True))
want = jax.jit(lambda: gated_delta_rule(pq, pk, pv, pg, pbeta, **meta, **popts))()
got = gated_delta_rule_sharded(meshes[2], pq, pk, pv, pg, pbeta, **meta, **popts)
assert rel(got[0][:cu[-1]], want[0][:cu[-1]]) <= 1e-6 and rel(got[1], want[1]) <= 1e-6
assert rel(got[2][:real], want[2][:real]) <= 1e-6
print("gdn: pallas_triton under the map ok")

g_raw, A_log, dt_bias = f32(T, HV, K), f32(HV, scale=0.5), f32(HV * K, scale=0.5)
h0_vk = f32(N, HV, V, K, scale=0.3)
kopts = dict(opts, state_layout="vk", A_log=A_log, dt_bias=dt_bias)
single = jax.jit(lambda: kda(q, k, v, g_raw, beta, initial_state=h0_vk, **meta, **kopts))()
compare("kda", single, lambda m: kda_sharded(m, q, k, v, g_raw, beta, initial_state=h0_vk, **meta, **kopts))

x, dt, z = f32(T, SSD_H, SSD_P), f32(T, SSD_H), f32(T, SSD_H, SSD_P)
A, D, ssd_bias = -jnp.exp(f32(SSD_H, scale=0.5)), f32(SSD_H, SSD_P), f32(SSD_H, scale=0.5)
Bm, Cm = f32(T, SSD_G, SSD_N), f32(T, SSD_G, SSD_N)
s0 = f32(N, SSD_H, SSD_P, SSD_N, scale=0.3)
sopts = dict(D=D, dt_bias=ssd_bias, z=z, initial_state=s0, chunk_size=16, implementation="xla")
single = jax.jit(lambda: ssd(x, dt, A, Bm, Cm, **meta, **sopts))()
# G = 2 groups: split on groups over 1 and 2 devices, replicated and sliced per shard over 4 and 8
compare("ssd", single, lambda m: ssd_sharded(m, x, dt, A, Bm, Cm, **meta, **sopts))

cx, weight, bias, c0 = f32(T, CONV_D), f32(CONV_D, CONV_W), f32(CONV_D), f32(N, CONV_D, CONV_W - 1)
single = jax.jit(lambda: causal_conv1d(cx, weight, bias, initial_state=c0, **meta, implementation="xla"))()
compare("conv", single, lambda m: causal_conv1d_sharded(m, cx, weight, bias, initial_state=c0, **meta), exact=True)

errors = []
for call in (lambda: gated_delta_rule_sharded(meshes[4], f32(T, 6, K), f32(T, 6, K), f32(T, 12, V),
                                              -jax.nn.softplus(f32(T, 12)), jax.nn.sigmoid(f32(T, 12)), **meta),
             lambda: ssd_sharded(meshes[4], f32(T, 12, SSD_P), dt[:, :1].repeat(12, 1), A[:1].repeat(12),
                                 f32(T, 3, SSD_N), f32(T, 3, SSD_N), **meta),
             lambda: causal_conv1d_sharded(meshes[8], f32(T, 12), f32(12, CONV_W), **meta),
             lambda: causal_conv1d_sharded(meshes[8], cx, weight, axis="model", **meta)):
    try:
        call()
    except ValueError as error:
        errors.append(str(error).split(":")[0])
assert errors == ["q", "B", "x", "axis"], errors
print("indivisible: ValueError", " ".join(errors))
"""


def test_sharded_ops_match_single_device():
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
                        "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for op in ("gdn", "kda", "ssd", "conv"):
        assert any(line.startswith(f"{op}: meshes 1 2 8 ok") for line in lines), result.stdout
    assert "gdn: split and batched ok" in lines, result.stdout
    assert "indivisible: ValueError q B x axis" in lines, result.stdout
