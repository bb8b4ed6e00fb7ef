"""The engine loop: continuous batching of many requests over an align-mode prefix cache, greedy decoding.

Each step packs the decode rows of every running request first, then prefill chunks of the running requests in
admission order under the step's token budget (`max_num_scheduled_tokens`, chunked prefill); waiting requests are
admitted as others finish. Four modes:
- "two_step": vLLM without internal checkpoints. The split (`block_aligned_split`, has_checkpoint_blocks=False) cuts
  the prompt at its last cacheable boundary, so a prompt crossing it needs one more step for its tail.
- "one_checkpoint": vLLM 0.33 with internal checkpoints. The prompt-finishing chunk runs whole and the layers
  export the state at the last boundary from inside the forward (`batch_checkpoints`, policy "vllm").
- "several": the extended mode. Every block boundary inside every chunk gets a checkpoint (policy "every_block"),
  so a shared prefix whose length is not a multiple of the block still leaves its boundary states behind.
- "no_prefix_cache": the baseline with prefix caching off: no lookups, nothing published, chunks cut only by the
  budget.

Which checkpoints a step exports comes only from `jaxckpt.plan`; the same answer reserves the cache slots, fills the
metadata handed to the model, and is committed to the cache after the forward returns, row by row: a row whose
logits or states come out non-finite fails alone and publishes nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from jaxckpt.engine.cache import NULL_PAGE, CacheStats, PrefixCache, PrefixHit, extend_block_hashes
from jaxckpt.engine.runner import HybridRunner, Step
from jaxckpt.plan import NULL_SLOT, batch_checkpoints
from jaxckpt.plan.conventions import check_positive
from jaxckpt.plan.scheduler import SchedulerConfig, block_aligned_split

MODES = ("two_step", "one_checkpoint", "several")
BASELINE = "no_prefix_cache"
ENGINE_MODES = MODES + (BASELINE,)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """`max_num_scheduled_tokens` is the per-step token budget; `max_num_seqs` the most requests running at once
    (admitted, holding pages); `max_checkpoints_per_row` bounds the "several" mode (None: every block boundary of
    the chunk)."""

    mode: str = "one_checkpoint"
    num_kv_pages: int = 512
    num_state_slots: int = 128
    max_new_tokens: int = 4
    max_num_scheduled_tokens: int = 256
    max_num_seqs: int = 8
    max_checkpoints_per_row: int | None = None

    def __post_init__(self):
        if self.mode not in ENGINE_MODES:
            raise ValueError(f"mode: must be one of {ENGINE_MODES}, got {self.mode!r}")
        check_positive(self.num_kv_pages, name="num_kv_pages")
        check_positive(self.num_state_slots, name="num_state_slots")
        check_positive(self.max_new_tokens, name="max_new_tokens")
        check_positive(self.max_num_scheduled_tokens, name="max_num_scheduled_tokens")
        check_positive(self.max_num_seqs, name="max_num_seqs")
        if self.max_num_seqs > self.max_num_scheduled_tokens:
            raise ValueError(f"max_num_seqs: {self.max_num_seqs} decode rows would not fit the token budget "
                             f"max_num_scheduled_tokens={self.max_num_scheduled_tokens}")
        if self.max_checkpoints_per_row is not None:
            check_positive(self.max_checkpoints_per_row, name="max_checkpoints_per_row")


@dataclasses.dataclass
class RequestResult:
    request_id: int
    prompt_len: int
    status: str                     # "finished", "failed" (reason says why) or "cancelled"
    reason: str | None
    hit_tokens: int                 # prefix served from the cache
    attention_hit_tokens: int       # what the attention pages alone matched (the rest lacked a recurrent state)
    prefill_forwards: int           # steps that ran a chunk of this prompt
    prefill_tokens: int             # prompt tokens computed by those steps
    checkpoints: int                # states exported from inside forwards for this request
    tail_step: bool                 # the prompt's last chunk was cut off at its last boundary (two_step's tail)
    arrival_s: float                # engine clock (compile time excluded) at add_request
    first_token_s: float | None     # engine clock when the first token came out
    finish_s: float | None
    first_logits: np.ndarray | None  # [vocab] logits of the prompt's last token
    generated: list[int]

    @property
    def ttft_s(self) -> float | None:
        """Arrival to first token: queueing, every prefill step and the steps in between, compile time excluded."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_s is None or self.finish_s is None or len(self.generated) < 2:
            return None
        return (self.finish_s - self.first_token_s) / (len(self.generated) - 1)


@dataclasses.dataclass
class StepRecord:
    """One engine step: what it ran and how long it took on the engine clock (compile time excluded)."""

    seconds: float
    num_tokens: int                 # real tokens (the runner pads to its bucket)
    num_decodes: int
    num_prefill_rows: int
    checkpoints: int
    tail_rows: int                  # rows whose chunk is a two_step tail (the rest after the last boundary)
    finished_prefills: int          # rows whose chunk finished their prompt


@dataclasses.dataclass
class EngineStats:
    prefill_forwards: int = 0       # steps holding at least one prefill row
    decode_forwards: int = 0        # steps holding decode rows only
    prefill_tokens: int = 0
    decode_tokens: int = 0
    checkpoints: int = 0
    published_states: int = 0
    failed_requests: int = 0

    @property
    def forwards(self) -> int:
        return self.prefill_forwards + self.decode_forwards


@dataclasses.dataclass
class _Request:
    request_id: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    arrival_s: float
    hashes: list[bytes] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    published_blocks: int = 0
    state_slot: int = NULL_SLOT
    num_computed: int = 0
    hit: PrefixHit | None = None
    prefill_forwards: int = 0
    prefill_tokens: int = 0
    checkpoints: int = 0
    tail_step: bool = False
    first_token_s: float | None = None
    first_logits: np.ndarray | None = None

    @property
    def in_decode(self) -> bool:
        return self.num_computed >= self.prompt_len

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclasses.dataclass
class _Row:
    req: _Request
    count: int
    decode: bool
    offsets: list[int]
    columns: list[int]
    slots: list[int] = dataclasses.field(default_factory=list)  # checkpoint slots, then the final slot


class Engine:
    """Serves requests through `runner` (see `jaxckpt.engine.runner`) with an align-mode prefix cache.

    `add_request` queues a prompt (or refuses it with ValueError), `step` runs one engine step, `cancel` drops a
    request, `run` drives a closed loop over many prompts. Time is the engine clock: perf_counter minus the runner's
    compile seconds.
    """

    def __init__(self, runner, config: EngineConfig = EngineConfig()):
        self.runner, self.config = runner, config
        self.block_size = check_positive(runner.block_size, name="block_size")
        self.caching = config.mode != BASELINE
        checkpointing = config.mode in ("one_checkpoint", "several")
        self.alignment = runner.checkpoint_alignment()
        if checkpointing:
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
            block_size=self.block_size, has_checkpoint_blocks=checkpointing,
            checkpoint_alignment=self.alignment if checkpointing else None,
            max_num_scheduled_tokens=config.max_num_scheduled_tokens)
        if config.mode == "several":
            per_step = config.max_num_scheduled_tokens // self.block_size + 1
            self.checkpoint_policy = ("every_block", min(config.max_checkpoints_per_row or per_step, per_step))
        elif config.mode == "one_checkpoint":
            self.checkpoint_policy = ("vllm", 1)
        else:
            self.checkpoint_policy = None
        self.cache = PrefixCache(block_size=self.block_size, num_kv_pages=config.num_kv_pages,
                                 num_state_slots=config.num_state_slots)
        runner.reset(num_kv_pages=config.num_kv_pages, num_state_slots=config.num_state_slots)
        self.stats = EngineStats()
        self.steps: list[StepRecord] = []
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.results: dict[int, RequestResult] = {}
        self._next_id = 0

    @property
    def cache_stats(self) -> CacheStats:
        return self.cache.stats

    def clock(self) -> float:
        return time.perf_counter() - self.runner.compile_seconds

    def check_prompt(self, prompt: Sequence[int], *, max_new_tokens: int | None = None) -> list[int]:
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError("prompt: must hold at least one token")
        vocab = self.runner.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"prompt: token ids must lie in [0, {vocab}), got range [{min(tokens)}, {max(tokens)}]")
        new = self.config.max_new_tokens if max_new_tokens is None else check_positive(max_new_tokens,
                                                                                       name="max_new_tokens")
        if len(tokens) + new > self.runner.max_model_len:
            raise ValueError(f"prompt: {len(tokens)} tokens + max_new_tokens={new} exceed "
                             f"max_model_len={self.runner.max_model_len}")
        pages = self._pages_needed(len(tokens), new)
        if pages > self.config.num_kv_pages - 1:
            raise ValueError(f"num_kv_pages: a request of {len(tokens)} + {new} tokens needs {pages} pages of "
                             f"{self.block_size}; the pool has {self.config.num_kv_pages - 1} usable (page 0 is null)")
        need = 1 + self._row_slots(len(tokens))
        if need > self.config.num_state_slots - 1:
            raise ValueError(f"num_state_slots: a request of {len(tokens)} tokens needs {need} slots in mode "
                             f"{self.config.mode!r} (its state, the next one and its checkpoints); the pool has "
                             f"{self.config.num_state_slots - 1} usable (slot 0 is null)")
        return tokens

    def _row_slots(self, prompt_len: int) -> int:
        """Slots one step of a request may take besides the one it holds: its final state and its checkpoints (at
        most one per block boundary inside a chunk)."""
        if self.checkpoint_policy is None:
            return 1
        boundaries = _cdiv(min(prompt_len, self.config.max_num_scheduled_tokens), self.block_size)
        return 1 + min(self.checkpoint_policy[1], boundaries)

    def _pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        # every token but the last generated one is written to the KV cache
        return _cdiv(prompt_len + max_new_tokens - 1, self.block_size)

    def add_request(self, prompt: Sequence[int], *, max_new_tokens: int | None = None) -> int:
        """Queues a prompt; returns its request id. Raises ValueError (naming the argument) for a prompt that could
        never run: empty, ids outside the vocabulary, over max_model_len, or larger than the pools."""
        tokens = self.check_prompt(prompt, max_new_tokens=max_new_tokens)
        req = _Request(request_id=self._next_id, tokens=tokens, prompt_len=len(tokens),
                       max_new_tokens=self.config.max_new_tokens if max_new_tokens is None else max_new_tokens,
                       arrival_s=self.clock())
        self._next_id += 1
        if self.caching:
            extend_block_hashes(req.hashes, tokens, block_size=self.block_size, num_tokens=len(tokens) - 1)
        self.waiting.append(req)
        return req.request_id

    def cancel(self, request_id: int) -> bool:
        """Drops a waiting or running request, freeing its pages and slots; False if it is not in flight."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                self._finish(req, "cancelled", None)
                return True
        for req in self.running:
            if req.request_id == request_id:
                self._retire(req, "cancelled", None)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self, req: _Request) -> bool:
        """Takes the request's prefix hit and every page it will write, if the pools can hold them with room left
        for each running request's next step; otherwise leaves everything as it was (the request waits)."""
        cache = self.cache
        hit = (cache.lookup(req.tokens[:req.prompt_len], hashes=req.hashes, record=False) if self.caching
               else PrefixHit(0, (), NULL_SLOT, 0))
        pages = self._pages_needed(req.prompt_len, req.max_new_tokens) - len(hit.pages)
        held = sum(r.state_slot != NULL_SLOT for r in self.running) + (hit.state_slot != NULL_SLOT)
        # every running request holds at most one slot between steps; room for one more row's step keeps the
        # engine moving whatever the others hold
        row_slots = max(self._row_slots(r.prompt_len) for r in self.running + [req])
        slots_ok = cache.available_slots >= row_slots + (len(self.running) + 1 - held)
        if cache.available_pages < pages or not slots_ok:
            cache.release_hit(hit)
            return False
        if self.caching:
            cache.record_lookup(hit, num_query_tokens=req.prompt_len)
        req.hit = hit
        req.pages = list(hit.pages) + [cache.allocate_page() for _ in range(pages)]
        req.published_blocks = len(hit.pages)
        req.state_slot = hit.state_slot
        req.num_computed = hit.num_tokens
        self.running.append(req)
        return True

    def _schedule(self) -> list[_Row]:
        while self.waiting and len(self.running) < self.config.max_num_seqs and self._admit(self.waiting[0]):
            self.waiting.popleft()
        budget = self.config.max_num_scheduled_tokens
        slots = self.cache.available_slots
        decodes, prefills = [], []
        for req in self.running:
            if req.in_decode and budget >= 1 and slots >= 1:
                decodes.append(_Row(req, 1, True, [], []))
                budget -= 1
                slots -= 1
        for req in self.running:
            if req.in_decode or budget == 0:
                continue
            offered = min(req.prompt_len - req.num_computed, budget)
            count = self._split(req, offered)
            if count == 0:
                continue
            if count < offered and req.num_computed + offered == req.prompt_len:
                # the split cut a chunk that would have finished the prompt: its rest is a tail of its own
                req.tail_step = True
            offsets, columns = self._checkpoints(req, count)
            if slots < 1 + len(offsets):
                continue
            prefills.append(_Row(req, count, False, offsets, columns))
            budget -= count
            slots -= 1 + len(offsets)
        return decodes + prefills

    def _split(self, req: _Request, offered: int) -> int:
        if not self.caching:
            return offered
        return block_aligned_split(self.split_config, num_prompt_tokens=req.prompt_len, num_tokens=req.prompt_len,
                                   num_computed_tokens=req.num_computed, num_new_tokens=offered)

    def _checkpoints(self, req: _Request, count: int) -> tuple[list[int], list[int]]:
        qs, qe = req.num_computed, req.num_computed + count
        if self.checkpoint_policy is None:
            return [], []
        policy, per_row = self.checkpoint_policy
        if policy == "vllm" and qe < req.prompt_len:
            return [], []  # budget-limited chunks never checkpoint in vLLM
        _, offsets, columns = batch_checkpoints([qs], [qe], hash_block_size=self.block_size,
                                                block_size=self.block_size, alignment=self.alignment,
                                                max_checkpoints_per_row=per_row, policy=policy)
        for offset, column in zip(offsets.tolist(), columns.tolist()):
            # hash unit = block: a checkpoint in column c is the state after (c + 1) blocks
            if qs + offset != (column + 1) * self.block_size:
                raise AssertionError(f"checkpoint at {qs + offset} does not match column {column}")
        return offsets.tolist(), columns.tolist()

    def step(self) -> StepRecord | None:
        """Admits what fits, runs one forward over the packed rows, commits row by row; None if nothing could run."""
        rows = self._schedule()
        if not rows:
            if self.running:
                raise RuntimeError(f"no row of {len(self.running)} running requests could be scheduled")
            return None
        began = self.clock()
        block, cache = self.block_size, self.cache
        for row in rows:
            req = row.req
            qe = req.num_computed + row.count
            if self.caching:
                extend_block_hashes(req.hashes, req.tokens, block_size=block, num_tokens=qe)
                row.slots = [cache.reserve_slot(req.hashes[c]) for c in row.columns]
                row.slots.append(cache.reserve_slot(req.hashes[qe // block - 1] if qe % block == 0 else None))
            else:
                row.slots = [cache.reserve_slot(None)]
        step = self._build(rows)
        try:
            logits = self.runner.forward(step)
            finite_states = self.runner.states_finite([s for row in rows for s in row.slots])
        except BaseException:
            for row in rows:
                cache.discard(row.slots)
            raise
        now = self.clock()
        record = StepRecord(seconds=now - began, num_tokens=len(step.tokens), num_decodes=step.num_decodes,
                            num_prefill_rows=len(rows) - step.num_decodes,
                            checkpoints=sum(len(r.offsets) for r in rows), tail_rows=0, finished_prefills=0)
        used = 0
        for row, row_logits in zip(rows, logits):
            finite = finite_states[used:used + len(row.slots)]
            used += len(row.slots)
            self._commit(row, row_logits, finite, now, record)
        self.steps.append(record)
        stats = self.stats
        if record.num_prefill_rows:
            stats.prefill_forwards += 1
        else:
            stats.decode_forwards += 1
        return record

    def _build(self, rows: list[_Row]) -> Step:
        counts = [row.count for row in rows]
        tables = np.full((len(rows), self.max_blocks), NULL_PAGE, np.int32)
        for n, row in enumerate(rows):
            tables[n, :len(row.req.pages)] = row.req.pages
        starts = [row.req.num_computed for row in rows]
        return Step(
            tokens=np.asarray([t for row, qs in zip(rows, starts) for t in row.req.tokens[qs:qs + row.count]],
                              np.int32),
            cu_seqlens=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            positions=np.concatenate([np.arange(qs, qs + c) for qs, c in zip(starts, counts)]).astype(np.int32),
            context_lens=np.asarray(starts, np.int32),
            block_tables=tables,
            initial_state_indices=np.asarray([row.req.state_slot for row in rows], np.int32),
            has_initial_state=np.asarray([qs > 0 for qs in starts]),
            final_state_indices=np.asarray([row.slots[-1] for row in rows], np.int32),
            checkpoint_cu=np.concatenate([[0], np.cumsum([len(row.offsets) for row in rows])]).astype(np.int32),
            checkpoint_offsets=np.asarray([o for row in rows for o in row.offsets], np.int32),
            checkpoint_state_indices=np.asarray([s for row in rows for s in row.slots[:-1]], np.int32),
            num_decodes=sum(row.decode for row in rows),
            request_ids=tuple(row.req.request_id for row in rows))

    def _commit(self, row: _Row, logits: np.ndarray, finite_states: np.ndarray, now: float, record: StepRecord):
        req, cache, block = row.req, self.cache, self.block_size
        qe = req.num_computed + row.count
        if not np.isfinite(logits).all() or not finite_states.all():
            what = "logits" if not np.isfinite(logits).all() else "recurrent states"
            cache.discard(row.slots)
            self.stats.failed_requests += 1
            self._retire(req, "failed", f"non-finite {what} in the step computing tokens [{req.num_computed}, {qe})"
                                        "; nothing of that step was published")
            return
        published = cache.commit(row.slots)
        for slot in row.slots[:-1]:
            cache.release_slot(slot)
        cache.release_slot(req.state_slot)
        req.state_slot = row.slots[-1]
        if self.caching:
            for j in range(req.published_blocks, qe // block):
                cache.publish_page(req.pages[j], req.hashes[j])
            req.published_blocks = max(req.published_blocks, qe // block)
        self.stats.published_states += published
        self.stats.checkpoints += len(row.offsets)
        if row.decode:
            self.stats.decode_tokens += 1
        else:
            self.stats.prefill_tokens += row.count
            req.prefill_forwards += 1
            req.prefill_tokens += row.count
            req.checkpoints += len(row.offsets)
            if qe == req.prompt_len:
                record.finished_prefills += 1
                record.tail_rows += req.tail_step
        req.num_computed = qe
        if not req.in_decode:
            return
        req.tokens.append(int(np.argmax(logits)))
        if req.first_token_s is None:
            req.first_token_s, req.first_logits = now, np.array(logits)
        if req.num_generated >= req.max_new_tokens:
            self._retire(req, "finished", None)

    def _retire(self, req: _Request, status: str, reason: str | None):
        self.running.remove(req)
        self.cache.release_pages(req.pages)
        self.cache.release_slot(req.state_slot)
        req.pages, req.state_slot = [], NULL_SLOT
        self._finish(req, status, reason)

    def _finish(self, req: _Request, status: str, reason: str | None):
        hit = req.hit or PrefixHit(0, (), NULL_SLOT, 0)
        self.results[req.request_id] = RequestResult(
            request_id=req.request_id, prompt_len=req.prompt_len, status=status, reason=reason,
            hit_tokens=hit.num_tokens, attention_hit_tokens=hit.attention_tokens,
            prefill_forwards=req.prefill_forwards, prefill_tokens=req.prefill_tokens, checkpoints=req.checkpoints,
            tail_step=req.tail_step, arrival_s=req.arrival_s, first_token_s=req.first_token_s,
            finish_s=self.clock() if status == "finished" else None, first_logits=req.first_logits,
            generated=req.tokens[req.prompt_len:])

    def run(self, prompts: Sequence[Sequence[int]], *, concurrency: int = 1,
            on_done: Callable[[RequestResult], None] | None = None) -> list[RequestResult]:
        """A closed loop: `concurrency` requests in flight, the next prompt submitted as each one ends; results in
        prompt order. Every prompt is checked before the first runs."""
        concurrency = check_positive(concurrency, name="concurrency")
        prompts = [self.check_prompt(p) for p in prompts]
        pending = deque(prompts)
        ids: list[int] = []
        in_flight: set[int] = set()
        while pending or in_flight:
            while pending and len(in_flight) < concurrency:
                ids.append(self.add_request(pending.popleft()))
                in_flight.add(ids[-1])
            if self.step() is None:
                raise RuntimeError("the engine ran nothing with requests in flight")
            for rid in [r for r in in_flight if r in self.results]:
                in_flight.discard(rid)
                if on_done is not None:
                    on_done(self.results[rid])
        return [self.results[rid] for rid in ids]

    def serve(self, prompt: Sequence[int]) -> RequestResult:
        return self.run([prompt])[0]


__all__ = ["BASELINE", "ENGINE_MODES", "MODES", "Engine", "EngineConfig", "EngineStats", "HybridRunner",
           "RequestResult", "Step", "StepRecord"]
