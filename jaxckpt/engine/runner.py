"""What the engine hands a model: one packed step (`Step`), and `HybridRunner`, which runs such steps on any model
called as `jaxckpt.models.hybrid.HybridModel` is (the hybrid model, Qwen3-Next, their head-sharded forms).

A runner owns the device caches and exposes: block_size, max_model_len, vocab_size, checkpoint_alignment(),
reset(num_kv_pages=, num_state_slots=), forward(step) -> logits [N, vocab] of each row's last token,
states_finite(slots) -> bool per slot, and compile_seconds (time spent compiling, kept out of the engine's clock).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxckpt.layers.metadata import StepMetadata, pack_tokens
from jaxckpt.models import hybrid
from jaxckpt.plan import bucket_size
from jaxckpt.plan.conventions import check_positive


@dataclasses.dataclass(frozen=True)
class Step:
    """One forward's host metadata over N rows, unpadded (the runner pads it to its shape buckets)."""

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
    num_decodes: int                      # the first num_decodes rows are single decode tokens
    request_ids: tuple[int, ...] = ()     # the engine's id of each row's request

    @property
    def num_rows(self) -> int:
        return len(self.cu_seqlens) - 1


@functools.partial(jax.jit, static_argnames=("recurrent",))
def _slots_finite(layers, slots, *, recurrent):
    """bool[len(slots)]: every recurrent layer's conv window and state at each slot is finite."""
    finite = jnp.ones(slots.shape, bool)
    for index in recurrent:
        for pool in layers[index]:
            finite &= jnp.isfinite(pool[slots]).reshape(slots.shape[0], -1).all(axis=1)
    return finite


class HybridRunner:
    """Runs engine steps on a `HybridModel`-like model: pads each step to a shape bucket, calls the jitted forward on
    the donated device caches, and times the first call of each shape apart as compile time.

    Shapes: a step holding only decode rows runs unpadded (N rows of one token: the ops return one output per decode
    row there, so padding tokens would not line up); it compiles once per decode row count. Any other step is padded
    to `bucket_size(T, minimum=prefill_tokens)` tokens (the next power of two: under 2x the real count once T reaches
    `prefill_tokens`), at least `num_rows` rows and `num_checkpoints` checkpoint entries, and runs with num_decodes=0:
    its decode rows are 1-token rows of the chunked path, so the compile key is the token bucket alone rather than
    the bucket times every decode count. `fill` is the initial value of every cache entry (nan poisons unwritten
    ones).

    With a `mesh`, the model runs split by head over its axis `axis` (`jaxckpt.models.sharded.ShardedHybrid`): the
    caches live in the sharded layout, the steps and every decision about them stay global.
    """

    def __init__(self, model, *, prefill_tokens: int = 256, num_rows: int = 1, num_checkpoints: int = 16,
                 fill: float = 0.0, mesh=None, axis: str = "heads"):
        self.model = model
        self.fill = fill
        config = model.config
        self.block_size, self.max_model_len = config.block_size, config.max_model_len
        self.vocab_size = config.vocab_size
        self.prefill_tokens = check_positive(prefill_tokens, name="prefill_tokens")
        self.num_rows = check_positive(num_rows, name="num_rows")
        self.num_checkpoints = check_positive(num_checkpoints, name="num_checkpoints")
        self.max_blocks = -(-self.max_model_len // self.block_size)
        if mesh is None:
            self.sharded = None
            self._forward = functools.partial(hybrid.forward, *nnx.split(model))
            self._init_caches = model.init_caches
        else:
            from jaxckpt.models.sharded import ShardedHybrid

            self.sharded = ShardedHybrid(model, mesh, axis=axis)
            self._forward = self.sharded.forward
            self._init_caches = self.sharded.init_caches
        self._recurrent = tuple(i for i, t in enumerate(config.layer_types) if t != "attention")
        self.compile_seconds = 0.0
        self.compiled: dict[tuple, float] = {}
        self.caches = None

    def checkpoint_alignment(self) -> int | None:
        return self.model.checkpoint_alignment()

    def reset(self, *, num_kv_pages: int, num_state_slots: int):
        self.num_kv_pages, self.num_state_slots = num_kv_pages, num_state_slots
        self.caches = self._init_caches(num_kv_pages, num_state_slots, fill=self.fill)

    def shape_of(self, step: Step) -> tuple[int, int, int, int]:
        """(tokens, rows, checkpoint entries, num_decodes) the step runs at."""
        num_rows, num_tokens = step.num_rows, len(step.tokens)
        if step.num_decodes == num_rows:
            return num_tokens, num_rows, bucket_size(len(step.checkpoint_offsets), minimum=self.num_checkpoints), \
                num_rows
        return (bucket_size(num_tokens, minimum=self.prefill_tokens), bucket_size(num_rows, minimum=self.num_rows),
                bucket_size(len(step.checkpoint_offsets), minimum=self.num_checkpoints), 0)

    def forward(self, step: Step) -> np.ndarray:
        if self.caches is None:
            raise ValueError("caches: call reset(num_kv_pages=, num_state_slots=) before forward")
        num_tokens, num_rows, num_checkpoints, num_decodes = self.shape_of(step)
        meta = StepMetadata.build(
            np.diff(step.cu_seqlens), context_lens=step.context_lens, block_tables=step.block_tables,
            initial_state_indices=step.initial_state_indices, final_state_indices=step.final_state_indices,
            has_initial_state=step.has_initial_state, checkpoint_cu=step.checkpoint_cu,
            checkpoint_offsets=step.checkpoint_offsets, checkpoint_state_indices=step.checkpoint_state_indices,
            num_decodes=num_decodes, block_size=self.block_size, num_kv_pages=self.num_kv_pages,
            num_state_slots=self.num_state_slots, max_model_len=self.max_model_len, num_tokens=num_tokens,
            num_rows=num_rows, num_checkpoints=num_checkpoints, max_blocks=self.max_blocks)
        tokens = pack_tokens([step.tokens], num_tokens)
        key = (num_tokens, num_rows, num_checkpoints, num_decodes, self.num_kv_pages, self.num_state_slots)
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
        return np.asarray(logits)[:step.num_rows]

    def states_finite(self, slots: Sequence[int]) -> np.ndarray:
        """bool per slot: the whole recurrent state written there (every layer) is finite."""
        slots = np.asarray(slots, np.int32)
        if not self._recurrent or slots.size == 0:
            return np.ones(slots.shape, bool)
        # a power-of-two slot count bounds the compiles; the padding repeats the first slot
        padded = np.full(bucket_size(slots.size, minimum=4), slots[0], np.int32)
        padded[:slots.size] = slots
        # the sharded layout keeps the slot axis first: a slot's entries over every shard are checked alike
        check = functools.partial(_slots_finite, self.caches.layers, padded, recurrent=self._recurrent)
        key = ("states_finite", padded.size, self.num_state_slots)
        if key not in self.compiled:
            began = time.perf_counter()
            jax.block_until_ready(check())
            self.compiled[key] = time.perf_counter() - began
            self.compile_seconds += self.compiled[key]
        return np.asarray(check())[:slots.size]

    def reference_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Per-token logits [T, vocab] of one uncached forward over `tokens` from a fresh state.

        The model is causal, so the tokens are padded to a power of two (at least `prefill_tokens`) and the padding's
        logits dropped: prompts of similar lengths reuse one set of compiled reference ops.
        """
        padded = np.zeros(bucket_size(len(tokens), minimum=self.prefill_tokens), np.int32)
        padded[:len(tokens)] = tokens
        return np.asarray(self.model.reference_logits(padded))[:len(tokens)]
