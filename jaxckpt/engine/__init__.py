"""An align-mode prefix-cache engine over the hybrid model: one forward per prompt, boundary states exported in-flight.

`cache` holds the KV pages and recurrent-state slots with content-hashed prefix matching; `scheduler` runs prompts in
three modes (vLLM's two-step split, vLLM's one internal checkpoint, a checkpoint at every block boundary); `demo` is
`jaxckpt demo`.
"""

from jaxckpt.engine.cache import NULL_PAGE, CacheStats, PrefixCache, PrefixHit, extend_block_hashes
from jaxckpt.engine.scheduler import MODES, Engine, EngineConfig, EngineStats, HybridRunner, RequestResult, Step

__all__ = ["CacheStats", "Engine", "EngineConfig", "EngineStats", "HybridRunner", "MODES", "NULL_PAGE", "PrefixCache",
           "PrefixHit", "RequestResult", "Step", "extend_block_hashes"]
