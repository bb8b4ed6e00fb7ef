"""`jaxckpt.plan` and the CLI's plan command work where jax and torch cannot be imported."""

import subprocess
import sys

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('jax', 'jaxlib', 'torch', 'triton', 'flax'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
"""


def run(code):
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True, timeout=120)


def test_plan_imports_without_jax_or_torch():
    result = run("import jaxckpt, jaxckpt.plan, jaxckpt.plan.spec, jaxckpt.plan.scheduler\n"
                 "print(jaxckpt.plan.checkpoint_position(8000, 768))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "7680"


def test_blocker_really_blocks():
    result = run("import jax")
    assert result.returncode != 0 and "blocked: jax" in result.stderr


def test_plan_command_prints_the_plan():
    result = run("from jaxckpt.cli import main; raise SystemExit(main(['plan']))")
    assert result.returncode == 0, result.stderr
    assert "7680 -> 9" in result.stdout and "split-at-checkpoint" in result.stdout
    bad = run("from jaxckpt.cli import main; raise SystemExit(main(['plan', '--block-size', '0']))")
    assert bad.returncode == 2 and "block_size" in bad.stderr
