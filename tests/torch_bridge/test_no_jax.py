"""torch_bridge imports and works where torch is installed and jax cannot be imported."""

import os
import subprocess
import sys

import pytest

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('jax', 'jaxlib', 'flax'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
"""


def run(code, **env):
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_blocker_really_blocks():
    result = run("import jax")
    assert result.returncode != 0 and "blocked: jax" in result.stderr


def test_package_import_is_lazy_and_spec_needs_no_torch():
    result = run("import torch_bridge, torch_bridge.spec, torch_bridge.ops\n"
                 "print(sorted(m for m in ('jax', 'torch', 'triton') if m in sys.modules))\n"
                 "print(torch_bridge.spec.derive_model_specs([], block_size=16, mamba_cache_mode='align'))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "[]"]


def test_bridge_modules_import_and_pool_helpers_run_without_jax():
    pytest.importorskip("torch")
    code = """
import numpy as np, torch
from torch_bridge import interop
from torch_bridge.ops import fla_prefill
slots = interop.pool_slots(5, 2, np.array([0, 1, 1]), 2, initial_state_indices=[-1, 3],
                           has_initial_state=np.array([True, True]), final_state_indices=[1, 2],
                           checkpoint_state_indices=[4, -1])
pool = torch.arange(5.0)[:, None].repeat(1, 2)
states = interop.gather_states(pool, slots.initial)
interop.write_states(pool, slots.final, states + 10)
print(states[:, 0].tolist(), pool[:, 0].tolist(), 'jax' in sys.modules)
"""
    result = run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0.0, 3.0] [0.0, 10.0, 13.0, 3.0, 4.0] False"


def test_spec_and_exporter_run_without_jax():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    code = f"""
import torch
from torch_bridge.spec import RecurrentLayer, derive_model_specs, mamba2_alignment
from torch_bridge.ops import export_checkpoints

class Mixer(RecurrentLayer):
    def get_state_shape(self):
        return ((4, 3), (2, 4, 4))
    def get_state_dtype(self):
        return (torch.float32, torch.float32)
    def get_prefill_checkpoint_alignment(self):
        return mamba2_alignment()

spec = derive_model_specs([Mixer(), Mixer()], block_size=16, mamba_cache_mode="align")[0]
x = torch.arange(40.0, device="{device}").reshape(10, 4)
pool = torch.full((3, 4, 3), float("nan"), device="{device}")
export_checkpoints(x, pool, [0, 10], [0, 1], [5], [2], alignment=spec.prefill_checkpoint_alignment)
assert torch.equal(pool[2], x[2:5].T) and torch.isnan(pool[:2]).all()
assert "jax" not in sys.modules
print(spec.num_prefill_checkpoint_blocks, spec.prefill_checkpoint_alignment)
"""
    env = {} if device == "cuda" else {"TRITON_INTERPRET": "1"}
    result = run(code, **env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1 1"


def test_torch_kernels_import_without_jax():
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    result = run("import torch_bridge.ops.ssd, torch_bridge.ops.fla_prefill, torch_bridge.ops.exporter, "
                 "torch_bridge.interop\nprint('ok')")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_vllm_plugin_module_imports_nothing_and_stays_off_without_the_variable():
    code = ("import os\nos.environ.pop('JAXCKPT_VLLM_PLUGIN', None)\n"
            "from torch_bridge import vllm_plugin\nvllm_plugin.register()\n"
            "print(sorted(m for m in ('jax', 'torch', 'vllm') if m in sys.modules), vllm_plugin.is_installed())")
    result = run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] False"
