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

from jaxckpt.plan.conventions import (check_choice, check_flag, check_int_array, check_non_negative,
                                      check_optional_positive, check_positive)

CHECKPOINT_POLICIES = ("vllm", "every_block", "positions")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _query(query_start, query_end) -> tuple[int, int]:
    query_start = check_non_negative(query_start, name="query_start")
    query_end = check_non_negative(query_end, name="query_end")
    if query_end < query_start:
        raise ValueError(f"query_end: {query_end} is before query_start {query_start}")
    return query_start, query_end


def _queries(query_starts, query_ends) -> tuple[list[int], list[int]]:
    starts = check_int_array(query_starts, name="query_starts")
    ends = check_int_array(query_ends, name="query_ends")
    if ends.size != starts.size:
        raise ValueError(f"query_ends: {ends.size} rows, query_starts has {starts.size}")
    if np.any(starts < 0):
        n = int(np.argmax(starts < 0))
        raise ValueError(f"query_starts: must be non-negative, got query_starts[{n}]={starts[n]}")
    if np.any(ends < starts):
        n = int(np.argmax(ends < starts))
        raise ValueError(f"query_ends: row {n} ends at {ends[n]}, before its query_starts[{n}]={starts[n]}")
    return starts.tolist(), ends.tolist()


def _rule_options(*, hash_block_size, block_size, alignment, drop_eagle_block, num_hash_lookahead_tokens) -> dict:
    return dict(hash_block_size=check_positive(hash_block_size, name="hash_block_size"),
                block_size=check_positive(block_size, name="block_size"),
                alignment=check_optional_positive(alignment, name="alignment"),
                drop_eagle_block=check_flag(drop_eagle_block, name="drop_eagle_block"),
                num_hash_lookahead_tokens=check_non_negative(num_hash_lookahead_tokens,
                                                             name="num_hash_lookahead_tokens"))


def checkpoint_position(num_tokens: int, hash_block_size: int, *, drop_eagle_block: bool = False,
                        num_hash_lookahead_tokens: int = 0) -> int:
    """The last cacheable hash boundary of a prompt of `num_tokens` tokens (vLLM never caches the last token).

    Under EAGLE block drop the lookup prunes the last matching block, so the checkpoint moves one unit earlier.
    """
    num_tokens = check_non_negative(num_tokens, name="num_tokens")
    hash_block_size = check_positive(hash_block_size, name="hash_block_size")
    drop_eagle_block = check_flag(drop_eagle_block, name="drop_eagle_block")
    num_hash_lookahead_tokens = check_non_negative(num_hash_lookahead_tokens, name="num_hash_lookahead_tokens")
    limit = num_tokens if drop_eagle_block else num_tokens - max(1, num_hash_lookahead_tokens)
    position = (limit // hash_block_size) * hash_block_size
    if drop_eagle_block:
        position -= hash_block_size
    return max(position, 0)


def checkpoint_column(query_end: int, block_size: int) -> int:
    """Block-table column of the checkpoint: the one just before the running-state column."""
    query_end = check_non_negative(query_end, name="query_end")
    block_size = check_positive(block_size, name="block_size")
    return _cdiv(query_end, block_size) - 2


def initial_state_column(query_start: int, block_size: int) -> int:
    """Block-table column holding the step's initial state; -1 for a fresh prompt."""
    query_start = check_non_negative(query_start, name="query_start")
    block_size = check_positive(block_size, name="block_size")
    return (query_start - 1) // block_size


def is_checkpoint_valid(query_start: int, query_end: int, position: int, *, hash_block_size: int, block_size: int,
                        alignment: int | None) -> bool:
    """Whether the kernel exports, and the cache may publish, the state at `position` inside [query_start, query_end).

    All must hold: the backend can export; the query starts on the hash grid; the checkpoint column lies after the
    initial-state column; at least one hash unit is computed before it; it is strictly inside the query; its offset
    from the query start is a multiple of `alignment`. A side effect relied on by the conv export: a valid
    checkpoint is at least B/2 tokens after the query start, so the conv window never reaches before it.
    """
    query_start, query_end = _query(query_start, query_end)
    position = check_non_negative(position, name="position")
    hash_block_size = check_positive(hash_block_size, name="hash_block_size")
    block_size = check_positive(block_size, name="block_size")
    alignment = check_optional_positive(alignment, name="alignment")
    if alignment is None:
        return False
    return (query_start % hash_block_size == 0
            and checkpoint_column(query_end, block_size) > initial_state_column(query_start, block_size)
            and query_start + hash_block_size <= position
            and query_start < position < query_end
            and (position - query_start) % alignment == 0)


def model_checkpoint_alignment(layer_alignments: Iterable[int | None]) -> int | None:
    """LCM of every recurrent layer's alignment (1 for none); None as soon as one layer cannot export."""
    try:
        alignments = list(layer_alignments)
    except TypeError:
        raise ValueError(f"layer_alignments: must be an iterable of positive ints or None, "
                         f"got {type(layer_alignments).__name__}") from None
    alignments = [check_optional_positive(a, name="layer_alignments") for a in alignments]
    if None in alignments:
        return None
    return math.lcm(1, *alignments)


def checkpoint_grid(alignment: int | None, *, prefix_match_unit: int | None, block_size: int) -> int:
    """The token grid checkpoint offsets stay on: lcm(prefix_match_unit, alignment) when a unit is set, else B.

    `block_size` may be None only when a prefix-match unit is set.
    """
    if alignment is None:
        raise ValueError("alignment: the checkpoint grid needs every recurrent layer to declare an alignment")
    alignment = check_positive(alignment, name="alignment")
    prefix_match_unit = check_optional_positive(prefix_match_unit, name="prefix_match_unit")
    block_size = check_optional_positive(block_size, name="block_size")
    if prefix_match_unit is None:
        if block_size is None:
            raise ValueError("block_size: required when prefix_match_unit is None (the grid is then the block)")
        return block_size
    return math.lcm(prefix_match_unit, alignment)


def prefill_checkpoints(query_starts: Sequence[int], query_ends: Sequence[int], *, hash_block_size: int,
                        block_size: int, alignment: int | None, drop_eagle_block: bool = False,
                        num_hash_lookahead_tokens: int = 0,
                        cache_hit_alignment_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's per-row checkpoint: (offsets i32[N], columns i32[N]); a declined row gets (0, -1).

    The position is the prompt's last boundary on the cache-hit grid (`cache_hit_alignment_tokens`, by default the
    hash unit) as seen from the end of this step.
    """
    starts, ends = _queries(query_starts, query_ends)
    options = _rule_options(hash_block_size=hash_block_size, block_size=block_size, alignment=alignment,
                            drop_eagle_block=drop_eagle_block, num_hash_lookahead_tokens=num_hash_lookahead_tokens)
    block_size = options["block_size"]
    unit = check_optional_positive(cache_hit_alignment_tokens, name="cache_hit_alignment_tokens")
    unit = options["hash_block_size"] if unit is None else unit
    offsets = np.zeros(len(starts), np.int32)
    columns = np.full(len(starts), -1, np.int32)
    for n, (qs, qe) in enumerate(zip(starts, ends)):
        pos = checkpoint_position(qe, unit, drop_eagle_block=options["drop_eagle_block"],
                                  num_hash_lookahead_tokens=options["num_hash_lookahead_tokens"])
        if is_checkpoint_valid(qs, qe, pos, hash_block_size=options["hash_block_size"], block_size=block_size,
                               alignment=options["alignment"]):
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
    query_start, query_end = _query(query_start, query_end)
    options = _rule_options(hash_block_size=hash_block_size, block_size=block_size, alignment=alignment,
                            drop_eagle_block=drop_eagle_block, num_hash_lookahead_tokens=num_hash_lookahead_tokens)
    hash_block_size, block_size, alignment = options["hash_block_size"], options["block_size"], options["alignment"]
    drop_eagle_block = options["drop_eagle_block"]
    num_hash_lookahead_tokens = options["num_hash_lookahead_tokens"]
    max_checkpoints_per_row = check_positive(max_checkpoints_per_row, name="max_checkpoints_per_row")
    policy = check_choice(policy, CHECKPOINT_POLICIES, name="policy")
    positions = check_int_array(positions, name="positions")
    if np.any(positions < 0):
        raise ValueError(f"positions: must be non-negative token positions, got {int(positions.min())}")
    if positions.size and policy != "positions":
        raise ValueError(f"positions: only read by policy='positions', got policy={policy!r}")
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
        candidates = sorted({(p // block_size) * block_size for p in positions.tolist()})
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
    starts, ends = _queries(query_starts, query_ends)
    options = _rule_options(hash_block_size=hash_block_size, block_size=block_size, alignment=alignment,
                            drop_eagle_block=drop_eagle_block, num_hash_lookahead_tokens=num_hash_lookahead_tokens)
    max_checkpoints_per_row = check_positive(max_checkpoints_per_row, name="max_checkpoints_per_row")
    policy = check_choice(policy, CHECKPOINT_POLICIES, name="policy")
    if positions is not None:
        try:
            num_positions = len(positions)
        except TypeError:
            raise ValueError(f"positions: must be one sequence of positions per row, got "
                             f"{type(positions).__name__}") from None
        if num_positions != len(starts):
            raise ValueError(f"positions: {num_positions} rows, query_starts has {len(starts)}")
    cu, offsets, columns = [0], [], []
    for n, (qs, qe) in enumerate(zip(starts, ends)):
        pairs = row_checkpoints(qs, qe, **options, max_checkpoints_per_row=max_checkpoints_per_row, policy=policy,
                                positions=() if positions is None else positions[n])
        offsets += [o for o, _ in pairs]
        columns += [c for _, c in pairs]
        cu.append(len(offsets))
    return np.asarray(cu, np.int32), np.asarray(offsets, np.int32), np.asarray(columns, np.int32)


get_mamba_prefill_checkpoint_position = checkpoint_position
is_mamba_prefill_checkpoint_valid = is_checkpoint_valid
