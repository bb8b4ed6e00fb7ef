"""Models built from jaxckpt.layers: the tiny hybrid LM of the demo, and published architectures read from Hugging
Face folders (`Qwen3NextForCausalLM`, `KimiLinearForCausalLM`, `GraniteMoeHybridForCausalLM` `.from_pretrained`).
See README.md beside this file."""

from jaxckpt.models.common import export_state, import_state
from jaxckpt.models.granitemoehybrid import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
from jaxckpt.models.hybrid import LAYER_TYPES, Caches, HybridConfig, HybridModel, forward
from jaxckpt.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM
from jaxckpt.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM

__all__ = ["Caches", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", "HybridConfig", "HybridModel", "KimiLinearConfig", "KimiLinearForCausalLM", "LAYER_TYPES",
           "Qwen3NextConfig", "Qwen3NextForCausalLM", "export_state", "forward", "import_state"]
