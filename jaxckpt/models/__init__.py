"""Models built from jaxckpt.layers: the hybrid attention/recurrent LM the engine serves."""

from jaxckpt.models.hybrid import LAYER_TYPES, Caches, HybridConfig, HybridModel, forward

__all__ = ["Caches", "HybridConfig", "HybridModel", "LAYER_TYPES", "forward"]
