"""Where a prefill checkpoint may be taken: the one rule set, vLLM 0.33.0-exact.

Scheduler, cache, planners, kernels, layers and torch_bridge all ask these functions, so they decline in lockstep: a
block that is reserved and hashed but never written would poison the prefix cache silently.

Words: `block_size` (B) is the align-mode state block (slot p holds the state after (p + 1)·B tokens);
`hash_block_size` (H) is the prefix-match unit (divides B); `alignment` (A) is the kernel's export granularity, an
offset from the query start must be a multiple of it (None: the backend cannot export from inside a forward).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from jaxckpt.plan.conventions import check_non_negative, check_positive

CHECKPOINT_POLICIES = ("vllm", "every_block", "positions")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def checkpoint_position(num_tokens: int, hash_block_size: int, *, drop_eagle_block: bool = False,
                        num_hash_lookahead_tokens: int = 0) -> int:
    """The last cacheable hash boundary of a prompt of `num_tokens` tokens (vLLM never caches the last token).

    Under EAGLE block drop the lookup prunes the last matching block, so the checkpoint moves one unit earlier.
    """
    check_non_negative(num_tokens, name="num_tokens")
    check_positive(hash_block_size, name="hash_block_size")
    check_non_negative(num_hash_lookahead_tokens, name="num_hash_lookahead_tokens")
    limit = num_tokens if drop_eagle_block else num_tokens - max(1, num_hash_lookahead_tokens)
    position = (limit // hash_block_size) * hash_block_size
    if drop_eagle_block:
        position -= hash_block_size
    return max(position, 0)


def checkpoint_column(query_end: int, block_size: int) -> int:
    """Block-table column of the checkpoint: the one just before the running-state column."""
    return _cdiv(query_end, block_size) - 2


def initial_state_column(query_start: int, block_size: int) -> int:
    """Block-table column holding the step's initial state; -1 for a fresh prompt."""
    return (query_start - 1) // block_size


def is_checkpoint_valid(query_start: int, query_end: int, position: int, *, hash_block_size: int, block_size: int,
                        alignment: int | None) -> bool:
    """Whether the kernel exports, and the cache may publish, the state at `position` inside [query_start, query_end).

    All must hold: the backend can export; the query starts on the hash grid; the checkpoint column lies after the
    initial-state column; at least one hash unit is computed before it; it is strictly inside the query; its offset
    from the query start is a multiple of `alignment`. A side effect relied on by the conv export: a valid
    checkpoint is at least B/2 tokens after the query start, so the conv window never reaches before it.
    """
    if alignment is None:
        return False
    check_positive(alignment, name="alignment")
    check_positive(hash_block_size, name="hash_block_size")
    check_positive(block_size, name="block_size")
    return (query_start % hash_block_size == 0
            and checkpoint_column(query_end, block_size) > initial_state_column(query_start, block_size)
            and query_start + hash_block_size <= position
            and query_start < position < query_end
            and (position - query_start) % alignment == 0)


def model_checkpoint_alignment(layer_alignments: Iterable[int | None]) -> int | None:
    """LCM of every recurrent layer's alignment (1 for none); None as soon as one layer cannot export."""
    result = 1
    for alignment in layer_alignments:
        if alignment is None:
            return None
        result = math.lcm(result, check_positive(alignment, name="layer_alignments"))
    return result


def checkpoint_grid(alignment: int | None, *, prefix_match_unit: int | None, block_size: int) -> int:
    """The token grid checkpoint offsets stay on: lcm(prefix_match_unit, alignment) when a unit is set, else B."""
    if alignment is None:
        raise ValueError("alignment: the checkpoint grid needs every recurrent layer to declare an alignment")
    check_positive(alignment, name="alignment")
    if prefix_match_unit is None:
        return check_positive(block_size, name="block_size")
    return math.lcm(check_positive(prefix_match_unit, name="prefix_match_unit"), alignment)


def prefill_checkpoints(query_starts: Sequence[int], query_ends: Sequence[int], *, hash_block_size: int,
                        block_size: int, alignment: int | None, drop_eagle_block: bool = False,
                        num_hash_lookahead_tokens: int = 0,
                        cache_hit_alignment_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's per-row checkpoint: (offsets i32[N], columns i32[N]); a declined row gets (0, -1).

    The position is the prompt's last boundary on the cache-hit grid (`cache_hit_alignment_tokens`, by default the
    hash unit) as seen from the end of this step.
    """
    unit = hash_block_size if cache_hit_alignment_tokens is None else cache_hit_alignment_tokens
    starts = np.asarray(query_starts, np.int64).reshape(-1)
    ends = np.asarray(query_ends, np.int64).reshape(-1)
    if starts.shape != ends.shape:
        raise ValueError(f"query_ends: shape {ends.shape} does not match query_starts {starts.shape}")
    if np.any(starts < 0) or np.any(ends < starts):
        raise ValueError("query_starts/query_ends: need 0 <= query_start <= query_end per row")
    offsets = np.zeros(starts.size, np.int32)
    columns = np.full(starts.size, -1, np.int32)
    for n, (qs, qe) in enumerate(zip(starts.tolist(), ends.tolist())):
        pos = checkpoint_position(qe, unit, drop_eagle_block=drop_eagle_block,
                                  num_hash_lookahead_tokens=num_hash_lookahead_tokens)
        if is_checkpoint_valid(qs, qe, pos, hash_block_size=hash_block_size, block_size=block_size,
                               alignment=alignment):
            offsets[n] = pos - qs
            columns[n] = checkpoint_column(qe, block_size)
    return offsets, columns


def row_checkpoints(query_start: int, query_end: int, *, hash_block_size: int, block_size: int,
                    alignment: int | None, max_checkpoints_per_row: int = 1, policy: str = "vllm",
                    positions: Sequence[int] = (), drop_eagle_block: bool = False,
                    num_hash_lookahead_tokens: int = 0) -> list[tuple[int, int]]:
    """Extended mode: up to `max_checkpoints_per_row` (offset, column) pairs for one row, ascending.

    vLLM's own last checkpoint comes first in priority; extra checkpoints sit on block boundaries (position m·B,
    column m − 1), strictly after the initial-state column and before vLLM's checkpoint column, and pass the same
    validity rule. Policies: "vllm" (the last checkpoint only), "every_block" (every block boundary in the query),
    "positions" (caller-given positions, e.g. a known shared-prefix junction, floored to the block grid). When more
    candidates qualify than slots remain, the latest are kept.
    """
    if policy not in CHECKPOINT_POLICIES:
        raise ValueError(f"policy: must be one of {CHECKPOINT_POLICIES}, got {policy!r}")
    check_positive(max_checkpoints_per_row, name="max_checkpoints_per_row")
    chosen: dict[int, int] = {}
    last = checkpoint_position(query_end, hash_block_size, drop_eagle_block=drop_eagle_block,
                               num_hash_lookahead_tokens=num_hash_lookahead_tokens)
    if is_checkpoint_valid(query_start, query_end, last, hash_block_size=hash_block_size, block_size=block_size,
                           alignment=alignment):
        chosen[last] = checkpoint_column(query_end, block_size)
    if policy == "vllm":
        candidates = []
    elif policy == "every_block":
        candidates = range(block_size, query_end, block_size)
    else:
        candidates = sorted({(int(p) // block_size) * block_size for p in positions})
    extra = []
    for pos in candidates:
        column = pos // block_size - 1
        if (initial_state_column(query_start, block_size) < column < checkpoint_column(query_end, block_size)
                and is_checkpoint_valid(query_start, query_end, pos, hash_block_size=hash_block_size,
                                        block_size=block_size, alignment=alignment)):
            extra.append((pos, column))
    room = max_checkpoints_per_row - len(chosen)
    for pos, column in (extra[-room:] if room > 0 else []):
        chosen[pos] = column
    return [(pos - query_start, chosen[pos]) for pos in sorted(chosen)]


def batch_checkpoints(query_starts: Sequence[int], query_ends: Sequence[int], *, hash_block_size: int,
                      block_size: int, alignment: int | None, max_checkpoints_per_row: int = 1,
                      policy: str = "vllm", positions: Sequence[Sequence[int]] | None = None,
                      drop_eagle_block: bool = False, num_hash_lookahead_tokens: int = 0):
    """`row_checkpoints` over a batch, in CSR form: (checkpoint_cu i32[N + 1], offsets i32[M], columns i32[M])."""
    starts = [int(s) for s in np.asarray(query_starts).reshape(-1)]
    ends = [int(e) for e in np.asarray(query_ends).reshape(-1)]
    if len(starts) != len(ends):
        raise ValueError(f"query_ends: {len(ends)} rows, query_starts has {len(starts)}")
    if positions is not None and len(positions) != len(starts):
        raise ValueError(f"positions: {len(positions)} rows, query_starts has {len(starts)}")
    cu, offsets, columns = [0], [], []
    for n, (qs, qe) in enumerate(zip(starts, ends)):
        pairs = row_checkpoints(qs, qe, hash_block_size=hash_block_size, block_size=block_size,
                                alignment=alignment, max_checkpoints_per_row=max_checkpoints_per_row,
                                policy=policy, positions=() if positions is None else positions[n],
                                drop_eagle_block=drop_eagle_block,
                                num_hash_lookahead_tokens=num_hash_lookahead_tokens)
        offsets += [o for o, _ in pairs]
        columns += [c for _, c in pairs]
        cu.append(len(offsets))
    return np.asarray(cu, np.int32), np.asarray(offsets, np.int32), np.asarray(columns, np.int32)


get_mamba_prefill_checkpoint_position = checkpoint_position
is_mamba_prefill_checkpoint_valid = is_checkpoint_valid
