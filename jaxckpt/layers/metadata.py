"""Per-step batch metadata shared by every layer of a model: packed rows, positions, KV pages and state slots.

One `StepMetadata` describes one engine step: the packed query tokens of N rows (decode rows first, one token each,
then prefill rows), where each row's tokens sit in its sequence, which KV-cache pages hold the sequence, and which
state-pool slots every recurrent layer reads its initial state from and writes its final and checkpoint states to.
All recurrent layers use the same slot numbers, so one slot is the whole recurrent state of a request at one point.

`StepMetadata.build` validates concrete host metadata once (with `jaxckpt.plan.conventions`) and pads it to bucket
sizes so that new batches seldom need a new compile; the layers trust the arrays they get (they may be traced).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np

from jaxckpt.plan.conventions import (NULL_SLOT, PAD_CHECKPOINT_OFFSET, check_int_array, validate_checkpoints,
                                      validate_slots)
from jaxckpt.plan.layout import bucket_size

_ARRAY_FIELDS = ("cu_seqlens", "positions", "context_lens", "block_tables", "initial_state_indices",
                 "has_initial_state", "final_state_indices", "checkpoint_cu", "checkpoint_offsets",
                 "checkpoint_state_indices")


def check_pool_sizes(num_kv_pages: int, num_state_slots: int) -> None:
    """ValueError unless the KV pool and the state pools hold a real entry beside the null page / slot 0."""
    if num_kv_pages < 2:
        raise ValueError(f"num_kv_pages: the KV pool needs at least 2 pages (page 0 is the null page), "
                         f"got {num_kv_pages}")
    if num_state_slots < 2:
        raise ValueError(f"num_state_slots: the state pools need at least 2 slots (slot 0 is the null slot), "
                         f"got {num_state_slots}")


def _padded(values, size: int, fill, dtype) -> np.ndarray:
    out = np.full(size, fill, dtype)
    out[:len(values)] = values
    return out


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(_ARRAY_FIELDS), meta_fields=["num_decodes"])
@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """Metadata of one packed step; arrays are leaves (may be traced), `num_decodes` is static.

    Rows past the real batch (bucket padding) have no tokens, no pages and the null slot everywhere; tokens past
    `cu_seqlens[N]` are padding (position 0, never written to a cache). Model outputs for padded rows are garbage.
    """

    cu_seqlens: jax.Array                # i32[N + 1] packed rows; decode rows first
    positions: jax.Array                 # i32[T] absolute position of each token in its sequence
    context_lens: jax.Array              # i32[N] tokens of the sequence before this step (the query start)
    block_tables: jax.Array              # i32[N, MAXB] KV-cache pages of each row; page 0 is the null page
    initial_state_indices: jax.Array     # i32[N] slot of each row's initial state
    has_initial_state: jax.Array         # bool[N] False: the row starts from zeros
    final_state_indices: jax.Array       # i32[N] slot the row's final state goes to (null slot: dropped)
    checkpoint_cu: jax.Array             # i32[N + 1] CSR checkpoints of each row
    checkpoint_offsets: jax.Array        # i32[M] query-relative offsets; padded entries PAD_CHECKPOINT_OFFSET
    checkpoint_state_indices: jax.Array  # i32[M] slot of each checkpoint; padded entries the null slot
    num_decodes: int = 0

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_rows(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    def paged_kwargs(self) -> dict:
        """The keyword arguments every `jaxckpt.ops.*_paged` entry takes from this step."""
        return dict(cu_seqlens=self.cu_seqlens, checkpoint_cu=self.checkpoint_cu,
                    checkpoint_offsets=self.checkpoint_offsets, initial_state_indices=self.initial_state_indices,
                    has_initial_state=self.has_initial_state, final_state_indices=self.final_state_indices,
                    checkpoint_state_indices=self.checkpoint_state_indices)

    @classmethod
    def build(cls, query_lens: Sequence[int], *, context_lens: Sequence[int], block_tables, initial_state_indices,
              final_state_indices, has_initial_state=None, checkpoint_cu=None, checkpoint_offsets=None,
              checkpoint_state_indices=None, num_decodes: int = 0, block_size: int, num_kv_pages: int,
              num_state_slots: int, max_model_len: int | None = None, num_tokens: int | None = None,
              num_rows: int | None = None, num_checkpoints: int | None = None,
              max_blocks: int | None = None) -> StepMetadata:
        """Validates host metadata of N rows and pads it to bucket sizes (numpy arrays, ready for `forward`).

        query_lens              # [N] tokens of each row in this step (decode rows first, `num_decodes` of them)
        context_lens            # [N] tokens of each sequence already in the caches
        block_tables            # [N, B] (lists may be ragged) pages holding each sequence; must cover
                                #   context + query tokens; page 0 is the null page
        initial_state_indices, final_state_indices   # [N] state slots; has_initial_state [N] (default:
                                #   context_lens > 0)
        checkpoint_cu, checkpoint_offsets, checkpoint_state_indices   # CSR checkpoints [N + 1], [M], [M]
        `num_tokens`, `num_rows`, `num_checkpoints`, `max_blocks` fix the padded sizes (default: the next bucket,
        `jaxckpt.plan.bucket_size`). Bad input raises ValueError naming the argument.
        """
        lens = check_int_array(query_lens, name="query_lens")
        if lens.size == 0:
            raise ValueError("query_lens: empty batch, a step needs at least one row")
        if np.any(lens <= 0):
            raise ValueError(f"query_lens: every row needs at least one token, got {lens.tolist()}")
        n = lens.size
        if not isinstance(num_decodes, int) or not 0 <= num_decodes <= n:
            raise ValueError(f"num_decodes: must be a Python int in [0, {n}], got {num_decodes!r}")
        if np.any(lens[:num_decodes] != 1):
            raise ValueError(f"num_decodes: the first {num_decodes} rows must hold one token each, got "
                             f"query_lens {lens[:num_decodes].tolist()}")
        ctx = check_int_array(context_lens, name="context_lens")
        if ctx.size != n:
            raise ValueError(f"context_lens: needs one entry per row ({n}), got {ctx.size}")
        if np.any(ctx < 0):
            raise ValueError(f"context_lens: must be non-negative, got {ctx.tolist()}")
        total = ctx + lens
        if max_model_len is not None and np.any(total > max_model_len):
            row = int(np.argmax(total > max_model_len))
            raise ValueError(f"query_lens: row {row} reaches {int(total[row])} tokens (context {int(ctx[row])} + "
                             f"query {int(lens[row])}), over max_model_len={max_model_len}")
        check_pool_sizes(num_kv_pages, num_state_slots)

        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        ccu, offsets = validate_checkpoints(checkpoint_cu, checkpoint_offsets, cu)
        real_ckpt = int(ccu[-1])
        if checkpoint_state_indices is None:
            if real_ckpt:
                raise ValueError("checkpoint_state_indices: needed for the checkpoints given")
            checkpoint_state_indices = np.zeros(offsets.size, np.int32)
        ckpt_slots = validate_slots(checkpoint_state_indices, num_state_slots, name="checkpoint_state_indices")
        if ckpt_slots.size != offsets.size:
            raise ValueError(f"checkpoint_state_indices: needs one slot per checkpoint entry ({offsets.size}), "
                             f"got {ckpt_slots.size}")
        if np.any(ckpt_slots[real_ckpt:] != NULL_SLOT):
            raise ValueError("checkpoint_state_indices: padded checkpoint entries must carry the null slot")
        initial = validate_slots(initial_state_indices, num_state_slots, name="initial_state_indices")
        final = validate_slots(final_state_indices, num_state_slots, name="final_state_indices")
        for name, slots in (("initial_state_indices", initial), ("final_state_indices", final)):
            if slots.size != n:
                raise ValueError(f"{name}: needs one slot per row ({n}), got {slots.size}")
        has_init = ctx > 0 if has_initial_state is None else np.asarray(has_initial_state, bool)
        if has_init.shape != (n,):
            raise ValueError(f"has_initial_state: needs one flag per row ({n}), got shape {has_init.shape}")
        if np.any(has_init & (initial == NULL_SLOT)):
            row = int(np.argmax(has_init & (initial == NULL_SLOT)))
            raise ValueError(f"initial_state_indices: row {row} has an initial state but the null slot {NULL_SLOT}")
        written = np.concatenate([final, ckpt_slots[:real_ckpt]])
        written = written[written != NULL_SLOT]
        if np.unique(written).size != written.size:
            raise ValueError("final_state_indices/checkpoint_state_indices: a slot is written twice in one step")

        tables = [np.asarray(row, np.int64).reshape(-1) for row in block_tables]
        if len(tables) != n:
            raise ValueError(f"block_tables: needs one page list per row ({n}), got {len(tables)}")
        needed = -(-total // block_size)
        for row, (pages, need) in enumerate(zip(tables, needed)):
            if pages.size < need:
                raise ValueError(f"block_tables: row {row} holds {int(total[row])} tokens and needs {int(need)} "
                                 f"pages of {block_size}, got {pages.size}")
            if np.any(pages < 0) or np.any(pages >= num_kv_pages):
                raise ValueError(f"block_tables: row {row} has pages outside [0, {num_kv_pages}) of the KV pool")
            if np.any(pages[:need] == 0):
                raise ValueError(f"block_tables: row {row} uses the null page 0 for real tokens")

        t_real = int(cu[-1])
        t_pad = bucket_size(t_real) if num_tokens is None else num_tokens
        n_pad = bucket_size(n, minimum=1) if num_rows is None else num_rows
        m_pad = bucket_size(offsets.size, minimum=4) if num_checkpoints is None else num_checkpoints
        width = max(int(needed.max()), max(p.size for p in tables))
        b_pad = bucket_size(width, minimum=1) if max_blocks is None else max_blocks
        for name, size, real in (("num_tokens", t_pad, t_real), ("num_rows", n_pad, n),
                                 ("num_checkpoints", m_pad, offsets.size), ("max_blocks", b_pad, int(needed.max()))):
            if size < real:
                raise ValueError(f"{name}: {size} is smaller than the {real} this step needs")

        positions = np.zeros(t_pad, np.int32)
        positions[:t_real] = np.concatenate([np.arange(c, c + q) for c, q in zip(ctx, lens)])
        table = np.zeros((n_pad, b_pad), np.int32)
        for row, pages in enumerate(tables):
            keep = pages[:b_pad]
            table[row, :keep.size] = keep
        return cls(
            cu_seqlens=_padded(cu, n_pad + 1, t_real, np.int32),
            positions=positions,
            context_lens=_padded(ctx, n_pad, 0, np.int32),
            block_tables=table,
            initial_state_indices=_padded(initial, n_pad, NULL_SLOT, np.int32),
            has_initial_state=_padded(has_init, n_pad, False, bool),
            final_state_indices=_padded(final, n_pad, NULL_SLOT, np.int32),
            checkpoint_cu=_padded(ccu, n_pad + 1, real_ckpt, np.int32),
            checkpoint_offsets=_padded(offsets[:real_ckpt], m_pad, PAD_CHECKPOINT_OFFSET, np.int32),
            checkpoint_state_indices=_padded(ckpt_slots[:real_ckpt], m_pad, NULL_SLOT, np.int32),
            num_decodes=num_decodes,
        )


def pack_tokens(token_rows: Sequence[Sequence[int]], num_tokens: int) -> np.ndarray:
    """The query tokens of each row packed into i32[num_tokens] (zeros past the real tokens), matching `build`."""
    flat = np.concatenate([np.asarray(row, np.int64).reshape(-1) for row in token_rows]) if token_rows else []
    if len(flat) > num_tokens:
        raise ValueError(f"token_rows: {len(flat)} tokens do not fit in num_tokens={num_tokens}")
    return _padded(flat, num_tokens, 0, np.int32)


def validate_step(tokens, meta: StepMetadata, *, num_state_slots: int | None, num_kv_pages: int | None) -> None:
    """Host checks of concrete step inputs against the caches they will index; skipped when anything is traced.

    Device gathers clamp and scatters drop out-of-range indices silently, so a slot or page past the end of a pool
    (a pool too small for the engine's tables) must be caught here.
    """
    leaves = [tokens, *jax.tree_util.tree_leaves(meta)]
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return
    if np.shape(tokens) != (meta.num_tokens,):
        raise ValueError(f"tokens: expected [T] with T = {meta.num_tokens} (meta.positions), got shape "
                         f"{np.shape(tokens)}")
    if num_state_slots is not None:
        for name in ("initial_state_indices", "final_state_indices", "checkpoint_state_indices"):
            validate_slots(np.asarray(getattr(meta, name)), num_state_slots, name=name)
    if num_kv_pages is not None:
        tables = np.asarray(meta.block_tables)
        if tables.size and (tables.min() < 0 or tables.max() >= num_kv_pages):
            raise ValueError(f"block_tables: pages must lie in [0, {num_kv_pages}) of the KV pool, got "
                             f"[{tables.min()}, {tables.max()}]")
