"""Every implementation behind the public entries runs as one jitted function, so a second call with new values of
the same shapes compiles nothing. (An implementation dispatched op by op compiles its Pallas kernels on every call:
seconds per call on a GPU.)"""

import importlib

import jax
import numpy as np
import pytest

from jaxckpt import ops
from jaxckpt.ops.conv1d.api import REGISTRY as CONV1D
from jaxckpt.ops.delta_rule.api import GDN_REGISTRY as GDN
from jaxckpt.ops.delta_rule.api import KDA_REGISTRY as KDA
from jaxckpt.ops.ssd.api import REGISTRY as SSD
from tests.ops.fuzz_cases import Bucket, call, random_batch

BUCKETS = {
    "gdn": Bucket("gdn", tokens=64, rows=3, checkpoints=4, heads=2, v_heads=4, key=16, value=16),
    "kda": Bucket("kda", tokens=64, rows=3, checkpoints=4, heads=2, v_heads=2, key=16, value=16),
    "ssd": Bucket("ssd", tokens=64, rows=3, checkpoints=4, heads=2, v_heads=1, key=16, value=32),
    "conv1d": Bucket("conv1d", tokens=64, rows=3, checkpoints=4, heads=8, key=4),
}
# sequence_parallel picks its pieces from the shapes on the host, then runs one jitted function (tested below);
# SSD's XLA path runs op by op: compiling it whole crashed a CI worker once (a segfault in XLA's CPU compile of a
# long bf16 row, not reproduced alone), so it stays eager until that is understood
EAGER = {("ssd", "xla")}
IMPLEMENTATIONS = [(op, name, path) for op, registry in [("gdn", GDN), ("kda", KDA), ("ssd", SSD), ("conv1d", CONV1D)]
                   for name, path in registry.items()
                   if name not in ("reference", "sequence_parallel") and (op, name) not in EAGER]


@pytest.mark.parametrize("op,name,path", IMPLEMENTATIONS, ids=[f"{op}-{name}" for op, name, _ in IMPLEMENTATIONS])
def test_every_implementation_is_jitted(op, name, path):
    module, function = path.split(":")
    assert callable(getattr(getattr(importlib.import_module(module), function), "lower", None)), path


def _compiles_of_second_call(op, implementation, **options):
    rng = np.random.default_rng()
    first, second = random_batch(rng, BUCKETS[op]), random_batch(rng, BUCKETS[op])
    jax.block_until_ready(call(first, implementation, **options))
    compiled = []  # names of the functions compiled by the second call

    def listener(event, duration, fun_name=None, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.block_until_ready(call(second, implementation, **options))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    # eager host-to-device copies compile a small `stage` program once per shape
    return [name for name in compiled if name != "stage"]


@pytest.mark.parametrize("op", sorted(BUCKETS))
def test_xla_second_call_compiles_nothing(op):
    assert _compiles_of_second_call(op, "xla") == []


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_sequence_parallel_second_call_compiles_nothing(op):
    assert _compiles_of_second_call(op, "sequence_parallel") == []


@pytest.mark.interpret
def test_pallas_triton_second_call_compiles_nothing():
    assert _compiles_of_second_call("ssd", "pallas_triton", config=ops.SsdPallasTritonConfig(interpret=True)) == []
