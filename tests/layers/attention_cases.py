"""Steps for the paged attention tests (CPU interpret mode and GPU): rows on randomly chosen KV pages."""

import numpy as np

from jaxckpt.layers.metadata import StepMetadata


def paged_step(rng, *, page, query_lens, context_lens, num_pages, num_decodes=0, **sizes) -> StepMetadata:
    """Host metadata of one step: each row's context and query tokens on distinct random pages (never the null page
    0), one more table entry than the longest row needs; rows with context resume from slot 1, each writes its final
    state to its own slot. `sizes`: `StepMetadata.build`'s padded sizes (num_tokens, num_rows)."""
    perm = rng.permutation(np.arange(1, num_pages))
    tables, used = [], 0
    for q, c in zip(query_lens, context_lens):
        need = -(-(q + c) // page)
        tables.append(perm[used:used + need])
        used += need
    n = len(query_lens)
    return StepMetadata.build(query_lens, context_lens=context_lens, block_tables=tables,
                              initial_state_indices=[1] * n, final_state_indices=list(range(2, n + 2)),
                              has_initial_state=[c > 0 for c in context_lens], num_decodes=num_decodes,
                              block_size=page, num_kv_pages=num_pages, num_state_slots=n + 2,
                              max_blocks=max(len(t) for t in tables) + 1, **sizes)
