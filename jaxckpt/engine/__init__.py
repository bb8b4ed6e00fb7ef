"""A continuous-batching prefix-cache engine over the hybrid model: boundary states exported in-flight.

`cache` holds the KV pages and recurrent-state slots with content-hashed prefix matching; `scheduler` packs decode
rows and prefill chunks of many requests per step in four modes (vLLM's two-step split, vLLM's one internal
checkpoint, a checkpoint at every block boundary, prefix caching off); `runner` runs the packed steps on a model;
`demo` is `jaxckpt demo`.
"""

from jaxckpt.engine.cache import NULL_PAGE, CacheStats, PrefixCache, PrefixHit, extend_block_hashes
from jaxckpt.engine.runner import HybridRunner, Step
from jaxckpt.engine.scheduler import (BASELINE, ENGINE_MODES, MODES, Engine, EngineConfig, EngineStats, RequestResult,
                                      StepRecord)

__all__ = ["BASELINE", "CacheStats", "ENGINE_MODES", "Engine", "EngineConfig", "EngineStats", "HybridRunner", "MODES",
           "NULL_PAGE", "PrefixCache", "PrefixHit", "RequestResult", "Step", "StepRecord", "extend_block_hashes"]
