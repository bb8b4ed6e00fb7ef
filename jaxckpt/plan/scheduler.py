"""Align-mode scheduling of one request's next prefill step, as vLLM 0.33.0's `_mamba_block_aligned_split`.

Without internal checkpoints a prompt whose last chunk crosses its last cacheable boundary is cut there and the rest
runs as a second model forward. With them, the chunk that finishes the prompt runs whole and the layers export the
boundary state from inside the forward; budget-limited chunks never checkpoint.
"""

from __future__ import annotations

import dataclasses

from jaxckpt.plan.conventions import check_flag, check_non_negative, check_optional_positive, check_positive
from jaxckpt.plan.rules import checkpoint_position, is_checkpoint_valid


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """What the split reads from vLLM's scheduler; sizes in tokens.

    `block_size` is the cache block (B); `hash_block_size` the prefix-match unit (H, default B);
    `scheduler_block_size` the LCM of the KV-cache groups' block sizes (default B); `checkpoint_alignment` the model's
    alignment and `has_checkpoint_blocks` whether every recurrent group reserves checkpoint blocks;
    `partial_cache_hit` defaults to H < scheduler block (vLLM also requires its coordinator to allow partial hits).
    """

    block_size: int
    hash_block_size: int | None = None
    scheduler_block_size: int | None = None
    has_checkpoint_blocks: bool = False
    checkpoint_alignment: int | None = None
    partial_cache_hit: bool | None = None
    eagle_block_drop: bool = False
    num_hash_lookahead_tokens: int = 0
    max_num_scheduled_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    shared_prefix_checkpoint: bool = False

    def __post_init__(self):
        checks = dict(block_size=check_positive, hash_block_size=check_optional_positive,
                      scheduler_block_size=check_optional_positive, has_checkpoint_blocks=check_flag,
                      checkpoint_alignment=check_optional_positive, eagle_block_drop=check_flag,
                      num_hash_lookahead_tokens=check_non_negative, max_num_scheduled_tokens=check_positive,
                      long_prefill_token_threshold=check_non_negative, shared_prefix_checkpoint=check_flag)
        for name, check in checks.items():
            # frozen: the checked value (a Python int, never a numpy scalar that could wrap) replaces the given one
            object.__setattr__(self, name, check(getattr(self, name), name=name))
        if self.partial_cache_hit is not None:
            object.__setattr__(self, "partial_cache_hit", check_flag(self.partial_cache_hit, name="partial_cache_hit"))
        if self.hash_block_size is not None and self.block_size % self.hash_block_size:
            raise ValueError(f"hash_block_size: {self.hash_block_size} must divide block_size {self.block_size}")
        if self.has_checkpoint_blocks and self.checkpoint_alignment is None:
            raise ValueError("checkpoint_alignment: required when has_checkpoint_blocks is set")
        if self.eagle_block_drop and self.num_hash_lookahead_tokens > 0:
            raise ValueError("eagle_block_drop: vLLM uses EAGLE block drop only without hash lookahead tokens")

    @property
    def hash_unit(self) -> int:
        return self.block_size if self.hash_block_size is None else self.hash_block_size

    @property
    def scheduler_block(self) -> int:
        return self.block_size if self.scheduler_block_size is None else self.scheduler_block_size

    @property
    def uses_partial_hits(self) -> bool:
        if self.partial_cache_hit is not None:
            return self.partial_cache_hit
        return self.hash_unit < self.scheduler_block


def block_aligned_split(config: SchedulerConfig, *, num_prompt_tokens: int, num_tokens: int,
                        num_computed_tokens: int, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
                        num_external_computed_tokens: int = 0, shared_prefix_boundary: int = 0) -> int:
    """How many of the offered `num_new_tokens` to schedule this step (0: cannot schedule now)."""
    if not isinstance(config, SchedulerConfig):
        raise ValueError(f"config: must be a SchedulerConfig, got {type(config).__name__}")
    num_prompt_tokens = check_non_negative(num_prompt_tokens, name="num_prompt_tokens")
    num_tokens = check_non_negative(num_tokens, name="num_tokens")
    num_computed_tokens = check_non_negative(num_computed_tokens, name="num_computed_tokens")
    num_new_tokens = check_non_negative(num_new_tokens, name="num_new_tokens")
    num_new_local_computed_tokens = check_non_negative(num_new_local_computed_tokens,
                                                       name="num_new_local_computed_tokens")
    num_external_computed_tokens = check_non_negative(num_external_computed_tokens,
                                                      name="num_external_computed_tokens")
    shared_prefix_boundary = check_non_negative(shared_prefix_boundary, name="shared_prefix_boundary")
    block = config.block_size
    unit = config.hash_unit
    eagle = config.eagle_block_drop
    lookahead = config.num_hash_lookahead_tokens
    partial = config.uses_partial_hits
    start = num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
    # resumed requests replay their output tokens as prefill
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if start >= prefill_end:
        return num_new_tokens

    last_cache_position = checkpoint_position(num_tokens, block, drop_eagle_block=eagle,
                                              num_hash_lookahead_tokens=lookahead)
    end = start + num_new_tokens
    position = checkpoint_position(prefill_end, unit if partial else config.scheduler_block, drop_eagle_block=eagle,
                                   num_hash_lookahead_tokens=lookahead)
    internal = (config.has_checkpoint_blocks and end >= prefill_end
                and is_checkpoint_valid(start, end, position, hash_block_size=unit, block_size=block,
                                        alignment=config.checkpoint_alignment))
    if internal:
        last_cache_position = 0
    # state is written at chunk ends, so non-final chunks end on block boundaries; a block wider than the step
    # budget advances sub-block and re-aligns at the next boundary
    if end < prefill_end:
        budget = config.max_num_scheduled_tokens
        if config.long_prefill_token_threshold > 0:
            budget = min(budget, config.long_prefill_token_threshold)
        aligned_end = end // block * block
        if aligned_end > start or block <= budget:
            end = aligned_end

    next_block_boundary = (start // block + 1) * block
    tail_boundary = (checkpoint_position(num_prompt_tokens, unit, drop_eagle_block=eagle,
                                         num_hash_lookahead_tokens=lookahead)
                     if partial and not internal else 0)
    junction = shared_prefix_boundary
    block_floored = start + (junction - start) // block * block
    junction_stop = junction if (config.shared_prefix_checkpoint and partial
                                 and junction <= num_prompt_tokens) else block_floored
    stops = (
        next_block_boundary if start % block != 0 and not internal else 0,
        last_cache_position,
        tail_boundary if last_cache_position < tail_boundary < num_prompt_tokens else 0,
        junction_stop if start < junction < end else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)
