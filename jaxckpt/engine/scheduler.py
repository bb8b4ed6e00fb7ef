"""The engine loop: align-mode prefill with a prefix cache, one request at a time, then a few greedy decode steps.

Three ways to produce the boundary states the cache needs:
- "two_step": vLLM without internal checkpoints. The split (`block_aligned_split`, has_checkpoint_blocks=False) cuts
  the prompt at its last cacheable boundary, so a prompt crossing it costs two forwards.
- "one_checkpoint": vLLM 0.33 with internal checkpoints. The prompt-finishing chunk runs whole and the layers
  export the state at the last boundary from inside the forward (`batch_checkpoints`, policy "vllm").
- "several": the extended mode. Every block boundary inside the query gets a checkpoint (policy "every_block"),
  so a shared prefix whose length is not a multiple of the block still leaves its boundary states behind.

Which checkpoints a step exports comes only from `jaxckpt.plan`; the same answer reserves the cache slots, fills the
metadata handed to the model, and is committed to the cache after the forward returns.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxckpt.engine.cache import NULL_PAGE, CacheStats, PrefixCache, extend_block_hashes
from jaxckpt.layers.metadata import StepMetadata, pack_tokens
from jaxckpt.models import hybrid
from jaxckpt.plan import NULL_SLOT, batch_checkpoints, bucket_size
from jaxckpt.plan.conventions import check_positive
from jaxckpt.plan.scheduler import SchedulerConfig, block_aligned_split

MODES = ("two_step", "one_checkpoint", "several")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Step:
    """One forward's host metadata, unpadded (the runner pads it to its shape buckets)."""

    tokens: np.ndarray                    # i32[T]
    cu_seqlens: np.ndarray                # i32[N + 1], decode rows first
    positions: np.ndarray                 # i32[T]
    context_lens: np.ndarray              # i32[N]
    block_tables: np.ndarray              # i32[N, MAXB]
    initial_state_indices: np.ndarray     # i32[N]
    has_initial_state: np.ndarray         # bool[N]
    final_state_indices: np.ndarray       # i32[N]
    checkpoint_cu: np.ndarray             # i32[N + 1]
    checkpoint_offsets: np.ndarray        # i32[M]
    checkpoint_state_indices: np.ndarray  # i32[M]
    num_decodes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """`max_num_scheduled_tokens` is the per-step token budget and also the token bucket every step is padded to;
    `max_checkpoints_per_row` bounds the "several" mode (None: every block boundary of the query)."""

    mode: str = "one_checkpoint"
    num_kv_pages: int = 512
    num_state_slots: int = 128
    max_new_tokens: int = 4
    max_num_scheduled_tokens: int = 256
    max_checkpoints_per_row: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {MODES}, got {self.mode!r}")
        check_positive(self.num_kv_pages, name="num_kv_pages")
        check_positive(self.num_state_slots, name="num_state_slots")
        check_positive(self.max_new_tokens, name="max_new_tokens")
        check_positive(self.max_num_scheduled_tokens, name="max_num_scheduled_tokens")
        if self.max_checkpoints_per_row is not None:
            check_positive(self.max_checkpoints_per_row, name="max_checkpoints_per_row")


@dataclasses.dataclass
class RequestResult:
    prompt_len: int
    hit_tokens: int                 # prefix served from the cache
    attention_hit_tokens: int       # what the attention pages alone matched (the rest lacked a recurrent state)
    prefill_forwards: int
    prefill_tokens: int             # tokens computed by prefill forwards
    checkpoints: int                # states exported from inside forwards
    ttft_s: float                   # lookup to first token, compile time excluded
    first_logits: np.ndarray        # [vocab] logits of the prompt's last token
    generated: list[int]


@dataclasses.dataclass
class EngineStats:
    prefill_forwards: int = 0
    decode_forwards: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    checkpoints: int = 0
    published_states: int = 0

    @property
    def forwards(self) -> int:
        return self.prefill_forwards + self.decode_forwards


@dataclasses.dataclass
class _Request:
    tokens: list[int]
    prompt_len: int
    pages: list[int]
    published_blocks: int
    state_slot: int
    num_computed: int
    hashes: list[bytes] = dataclasses.field(default_factory=list)


class Engine:
    """Serves prompts through `runner` (see `HybridRunner`) with an align-mode prefix cache.

    The runner owns the device caches and exposes block_size, max_model_len, vocab_size, checkpoint_alignment(),
    reset(num_kv_pages=, num_state_slots=), forward(step) -> logits [N, vocab] and compile_seconds.
    """

    def __init__(self, runner, config: EngineConfig = EngineConfig()):
        self.runner, self.config = runner, config
        self.block_size = check_positive(runner.block_size, name="block_size")
        self.alignment = runner.checkpoint_alignment()
        if config.mode != "two_step":
            if self.alignment is None:
                raise ValueError(f"mode: {config.mode!r} needs a model whose recurrent layers export checkpoints "
                                 "(checkpoint_alignment() is None); use 'two_step'")
            if self.block_size % self.alignment:
                raise ValueError(f"block_size: {self.block_size} must be a multiple of the model's checkpoint "
                                 f"alignment {self.alignment}")
        if config.max_num_scheduled_tokens < self.block_size:
            raise ValueError(f"max_num_scheduled_tokens: {config.max_num_scheduled_tokens} is below the block size "
                             f"{self.block_size}; the split could not advance")
        self.max_blocks = _cdiv(runner.max_model_len, self.block_size)
        self.split_config = SchedulerConfig(
            block_size=self.block_size, has_checkpoint_blocks=config.mode != "two_step",
            checkpoint_alignment=self.alignment if config.mode != "two_step" else None,
            max_num_scheduled_tokens=config.max_num_scheduled_tokens)
        if config.mode == "several":
            self.checkpoint_policy = ("every_block", config.max_checkpoints_per_row or self.max_blocks)
        else:
            self.checkpoint_policy = ("vllm", 1)
        self.cache = PrefixCache(block_size=self.block_size, num_kv_pages=config.num_kv_pages,
                                 num_state_slots=config.num_state_slots)
        runner.reset(num_kv_pages=config.num_kv_pages, num_state_slots=config.num_state_slots)
        self.stats = EngineStats()

    @property
    def cache_stats(self) -> CacheStats:
        return self.cache.stats

    def check_prompt(self, prompt: Sequence[int]) -> list[int]:
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError("prompt: must hold at least one token")
        vocab = self.runner.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"prompt: token ids must lie in [0, {vocab}), got range [{min(tokens)}, {max(tokens)}]")
        total = len(tokens) + self.config.max_new_tokens
        if total > self.runner.max_model_len:
            raise ValueError(f"prompt: {len(tokens)} tokens + max_new_tokens={self.config.max_new_tokens} exceed "
                             f"max_model_len={self.runner.max_model_len}")
        return tokens

    def run(self, prompts: Sequence[Sequence[int]], *,
            on_done: Callable[[RequestResult], None] | None = None) -> list[RequestResult]:
        prompts = [self.check_prompt(p) for p in prompts]
        results = []
        for prompt in prompts:
            results.append(self.serve(prompt))
            if on_done is not None:
                on_done(results[-1])
        return results

    def serve(self, prompt: Sequence[int]) -> RequestResult:
        tokens = self.check_prompt(prompt)
        compile_before = self.runner.compile_seconds
        start = time.perf_counter()
        req = _Request(tokens=tokens, prompt_len=len(tokens), pages=[], published_blocks=0, state_slot=NULL_SLOT,
                       num_computed=0)
        extend_block_hashes(req.hashes, tokens[:len(tokens) - 1], block_size=self.block_size)
        hit = self.cache.lookup(tokens, hashes=req.hashes)
        req.pages = list(hit.pages)
        req.published_blocks = len(hit.pages)
        req.state_slot = hit.state_slot
        req.num_computed = hit.num_tokens
        forwards = computed = checkpoints = 0
        try:
            while req.num_computed < req.prompt_len:
                offered = min(req.prompt_len - req.num_computed, self.config.max_num_scheduled_tokens)
                count = block_aligned_split(self.split_config, num_prompt_tokens=req.prompt_len,
                                            num_tokens=req.prompt_len, num_computed_tokens=req.num_computed,
                                            num_new_tokens=offered)
                if count == 0:
                    raise RuntimeError(f"the split scheduled 0 tokens at {req.num_computed}/{req.prompt_len}")
                logits, exported = self._step(req, count, decode=False)
                forwards += 1
                computed += count
                checkpoints += exported
            first_logits = logits
            req.tokens.append(int(np.argmax(first_logits)))
            ttft = time.perf_counter() - start - (self.runner.compile_seconds - compile_before)
            for _ in range(self.config.max_new_tokens - 1):
                logits, _ = self._step(req, 1, decode=True)
                req.tokens.append(int(np.argmax(logits)))
        finally:
            self.cache.release_pages(req.pages)
            self.cache.release_slot(req.state_slot)
        return RequestResult(prompt_len=req.prompt_len, hit_tokens=hit.num_tokens,
                             attention_hit_tokens=hit.attention_tokens, prefill_forwards=forwards,
                             prefill_tokens=computed, checkpoints=checkpoints, ttft_s=ttft,
                             first_logits=np.asarray(first_logits), generated=req.tokens[req.prompt_len:])

    def _step(self, req: _Request, count: int, *, decode: bool) -> tuple[np.ndarray, int]:
        """One forward over req.tokens[num_computed:num_computed + count]; returns (last-token logits, checkpoints)."""
        block = self.block_size
        qs, qe = req.num_computed, req.num_computed + count
        if decode or self.config.mode == "two_step":
            offsets, columns = np.zeros(0, np.int32), np.zeros(0, np.int32)
        else:
            policy, per_row = self.checkpoint_policy
            _, offsets, columns = batch_checkpoints([qs], [qe], hash_block_size=block, block_size=block,
                                                    alignment=self.alignment, max_checkpoints_per_row=per_row,
                                                    policy=policy)
        extend_block_hashes(req.hashes, req.tokens[:qe], block_size=block)
        for offset, column in zip(offsets.tolist(), columns.tolist()):
            # hash unit = block: a checkpoint in column c is the state after (c + 1) blocks
            if qs + offset != (column + 1) * block:
                raise AssertionError(f"checkpoint at {qs + offset} does not match column {column}")
        new_pages = _cdiv(qe, block) - len(req.pages)
        self.cache.ensure(pages=new_pages, slots=1 + len(offsets))
        req.pages += [self.cache.allocate_page() for _ in range(new_pages)]
        checkpoint_slots = [self.cache.reserve_slot(req.hashes[c]) for c in columns.tolist()]
        final_slot = self.cache.reserve_slot(req.hashes[qe // block - 1] if qe % block == 0 else None)
        written = checkpoint_slots + [final_slot]

        block_table = np.full((1, self.max_blocks), NULL_PAGE, np.int32)
        block_table[0, :len(req.pages)] = req.pages
        step = Step(
            tokens=np.asarray(req.tokens[qs:qe], np.int32),
            cu_seqlens=np.asarray([0, count], np.int32),
            positions=np.arange(qs, qe, dtype=np.int32),
            context_lens=np.asarray([qs], np.int32),
            block_tables=block_table,
            initial_state_indices=np.asarray([req.state_slot], np.int32),
            has_initial_state=np.asarray([qs > 0]),
            final_state_indices=np.asarray([final_slot], np.int32),
            checkpoint_cu=np.asarray([0, len(offsets)], np.int32),
            checkpoint_offsets=offsets.astype(np.int32),
            checkpoint_state_indices=np.asarray(checkpoint_slots, np.int32),
            num_decodes=1 if decode else 0)
        try:
            logits = self.runner.forward(step)
        except BaseException:
            self.cache.discard(written)
            raise
        published = self.cache.commit(written)
        for slot in checkpoint_slots:
            self.cache.release_slot(slot)
        self.cache.release_slot(req.state_slot)
        req.state_slot = final_slot
        for j in range(req.published_blocks, qe // block):
            self.cache.publish_page(req.pages[j], req.hashes[j])
        req.published_blocks = max(req.published_blocks, qe // block)
        req.num_computed = qe

        stats = self.stats
        if decode:
            stats.decode_forwards += 1
            stats.decode_tokens += count
        else:
            stats.prefill_forwards += 1
            stats.prefill_tokens += count
            stats.checkpoints += len(offsets)
        stats.published_states += published
        return np.asarray(logits)[0], len(offsets)


class HybridRunner:
    """Runs engine steps on `jaxckpt.models.hybrid`: pads each step to a shape bucket, calls the jitted forward on the
    device caches, and times the first call of each bucket apart as compile time (on a scratch copy of the caches).

    Prefill steps are padded to at least `prefill_tokens` tokens, decode steps to `decode_tokens`, checkpoint lists
    to `num_checkpoints` entries, so a demo or test run compiles one prefill and one decode shape. Decode steps stay
    unpadded by default: the ops return one output per decode row when a step holds only decode rows, so padding
    tokens there would not line up. `fill` is the initial value of every cache entry (nan poisons unwritten ones).

    With a `mesh`, the model runs split by head over its axis `axis` (`jaxckpt.models.sharded.ShardedHybrid`): the
    caches live in the sharded layout, the steps and every decision about them stay global.
    """

    def __init__(self, model, *, prefill_tokens: int = 256, decode_tokens: int = 1, num_checkpoints: int = 16,
                 fill: float = 0.0, mesh=None, axis: str = "heads"):
        self.model = model
        self.fill = fill
        config = model.config
        self.block_size, self.max_model_len = config.block_size, config.max_model_len
        self.vocab_size = config.vocab_size
        self.prefill_tokens = check_positive(prefill_tokens, name="prefill_tokens")
        self.decode_tokens = check_positive(decode_tokens, name="decode_tokens")
        self.num_checkpoints = check_positive(num_checkpoints, name="num_checkpoints")
        if mesh is None:
            self.sharded = None
            self._forward = functools.partial(hybrid.forward, *nnx.split(model))
            self._init_caches = model.init_caches
        else:
            from jaxckpt.models.sharded import ShardedHybrid

            self.sharded = ShardedHybrid(model, mesh, axis=axis)
            self._forward = self.sharded.forward
            self._init_caches = self.sharded.init_caches
        self.compile_seconds = 0.0
        self.compiled: dict[tuple, float] = {}
        self.caches = None

    def checkpoint_alignment(self) -> int | None:
        return self.model.checkpoint_alignment()

    def reset(self, *, num_kv_pages: int, num_state_slots: int):
        self.num_kv_pages, self.num_state_slots = num_kv_pages, num_state_slots
        self.caches = self._init_caches(num_kv_pages, num_state_slots, fill=self.fill)

    def forward(self, step: Step) -> np.ndarray:
        if self.caches is None:
            raise ValueError("caches: call reset(num_kv_pages=, num_state_slots=) before forward")
        num_rows = len(step.cu_seqlens) - 1
        minimum = self.decode_tokens if step.num_decodes else self.prefill_tokens
        num_tokens = bucket_size(len(step.tokens), minimum=minimum)
        meta = StepMetadata.build(
            np.diff(step.cu_seqlens), context_lens=step.context_lens, block_tables=step.block_tables,
            initial_state_indices=step.initial_state_indices, final_state_indices=step.final_state_indices,
            has_initial_state=step.has_initial_state, checkpoint_cu=step.checkpoint_cu,
            checkpoint_offsets=step.checkpoint_offsets, checkpoint_state_indices=step.checkpoint_state_indices,
            num_decodes=step.num_decodes, block_size=self.block_size, num_kv_pages=self.num_kv_pages,
            num_state_slots=self.num_state_slots, max_model_len=self.max_model_len, num_tokens=num_tokens,
            num_rows=bucket_size(num_rows, minimum=1),
            num_checkpoints=bucket_size(len(step.checkpoint_offsets), minimum=self.num_checkpoints),
            max_blocks=step.block_tables.shape[1])
        tokens = pack_tokens([step.tokens], num_tokens)
        key = (tokens.shape, meta.block_tables.shape, meta.checkpoint_offsets.shape, meta.num_decodes,
               self.num_kv_pages, self.num_state_slots)
        if key not in self.compiled:
            # the caches are donated, so the warm-up calls run on copies and their results are dropped; the second
            # call is warm-up too (the first run after a compile is still several times slower than steady state)
            began = time.perf_counter()
            for _ in range(2):
                scratch = jax.tree.map(jnp.copy, self.caches)
                jax.block_until_ready(self._forward(tokens, meta, scratch))
            self.compiled[key] = time.perf_counter() - began
            self.compile_seconds += self.compiled[key]
        logits, self.caches = self._forward(tokens, meta, self.caches)
        if self.sharded is not None:
            # the engine publishes this step's slots when forward returns, and reading the logits waits for one
            # shard only: wait until every shard has written its part of the caches
            jax.block_until_ready(self.caches)
        return np.asarray(logits)[:num_rows]

    def reference_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Per-token logits [T, vocab] of one uncached forward over `tokens` from a fresh state.

        The model is causal, so the tokens are padded to the prefill bucket and the padding's logits dropped: every
        prompt then reuses one set of compiled reference ops instead of compiling them per length.
        """
        padded = np.zeros(bucket_size(len(tokens), minimum=self.prefill_tokens), np.int32)
        padded[:len(tokens)] = tokens
        return np.asarray(self.model.reference_logits(padded))[:len(tokens)]
