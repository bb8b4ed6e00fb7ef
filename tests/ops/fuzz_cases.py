"""Random batches for the fuzz and isolation suites (CPU and GPU): one fixed shape per bucket, random metadata.

A bucket fixes every array shape (token capacity T, rows N, checkpoint entries M, heads and widths), so one compiled
program serves every batch drawn in it: row lengths (0, 1, chunk multiples +- 1, anything), checkpoints per row,
fresh or continued rows and the values change, the shapes do not. Tokens past `cu_seqlens[N]` and checkpoint entries
past `checkpoint_cu[N]` are padding and are filled with NaN, so every batch also checks that padding stays out.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxckpt import ops
from jaxckpt.ops.common.configs import DELTA_CONFIGS, SSD_CONFIGS
from tests.numerics import rel_rms

CHUNK = 64


@dataclasses.dataclass(frozen=True)
class Bucket:
    op: str                 # "gdn", "kda", "ssd" or "conv1d"
    tokens: int             # T
    rows: int               # N
    checkpoints: int        # M
    heads: int = 2          # H (GDN/KDA key heads, SSD heads), D for conv1d
    v_heads: int = 2        # HV (GDN/KDA); SSD groups G divide `heads`
    key: int = 8            # K (GDN/KDA), P (SSD), conv width W (conv1d)
    value: int = 8          # V (GDN/KDA), N (SSD)


@dataclasses.dataclass
class Batch:
    bucket: Bucket
    arrays: dict            # per-token inputs by argument name (padding tokens NaN)
    params: dict            # per-head parameters (SSD's A, conv1d's weight and bias)
    initial_state: np.ndarray  # [N, *state]; rows with has_initial_state False hold zeros
    has_initial_state: np.ndarray  # bool[N]
    cu_seqlens: np.ndarray  # i32[N + 1]
    checkpoint_cu: np.ndarray  # i32[N + 1]
    checkpoint_offsets: np.ndarray  # i32[M], padded entries 0

    @property
    def state_shape(self) -> tuple[int, ...]:
        return self.initial_state.shape[1:]

    @property
    def real_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def real_checkpoints(self) -> int:
        return int(self.checkpoint_cu[-1])

    def metadata(self) -> dict:
        return dict(cu_seqlens=self.cu_seqlens, checkpoint_cu=self.checkpoint_cu,
                    checkpoint_offsets=self.checkpoint_offsets)


SPECIAL_LENGTHS = (0, 1, 2, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK + 1)


def row_lengths(rng, bucket: Bucket) -> list[int]:
    """N lengths summing to at most T: special lengths, random ones, cut to fit."""
    lengths = []
    left = bucket.tokens
    for _ in range(bucket.rows):
        want = int(rng.choice(SPECIAL_LENGTHS)) if rng.random() < 0.6 else int(rng.integers(0, bucket.tokens // 2))
        lengths.append(min(want, left))
        left -= lengths[-1]
    return lengths


def checkpoints_for(rng, lengths: list[int], capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR checkpoints, each row up to three strictly increasing offsets in (0, length), at most `capacity` in all."""
    per_row = []
    for length in lengths:
        count = min(int(rng.integers(0, 4)), max(length - 1, 0), capacity - sum(map(len, per_row)))
        offsets = np.sort(rng.choice(np.arange(1, length), size=count, replace=False)) if count else []
        per_row.append([int(o) for o in offsets])
    cu = np.cumsum([0] + [len(o) for o in per_row]).astype(np.int32)
    offsets = np.zeros(capacity, np.int32)
    flat = [o for row in per_row for o in row]
    offsets[:len(flat)] = flat
    return cu, offsets


def _log_decays(rng, shape, *, strong: bool):
    """Log decays <= 0 of moderate size; with `strong`, a few tokens take -inf (a reset), -1e4 or -30."""
    g = np.log(rng.uniform(0.5, 1.0, shape)).astype(np.float32)
    if strong:
        hits = rng.random(shape[0]) < 0.05
        g[hits] = rng.choice(np.array([-np.inf, -1e4, -30.0], np.float32), size=(int(hits.sum()), *shape[1:]))
    return g


def random_batch(rng, bucket: Bucket, *, lengths=None, strong_decays: bool = True, dtype=np.float32) -> Batch:
    """A batch in `bucket`; `lengths` (N row lengths summing to at most T) drawn from `rng` when not given."""
    lengths = row_lengths(rng, bucket) if lengths is None else [int(n) for n in lengths]
    if len(lengths) != bucket.rows or sum(lengths) > bucket.tokens:
        raise ValueError(f"lengths: need {bucket.rows} rows within {bucket.tokens} tokens, got {lengths}")
    cu = np.cumsum([0] + lengths).astype(np.int32)
    ccu, offsets = checkpoints_for(rng, lengths, bucket.checkpoints)
    n, t = bucket.rows, bucket.tokens
    has_initial = rng.random(n) < 0.6
    params = {}
    if bucket.op in ("gdn", "kda"):
        h, hv, kd, vd = bucket.heads, bucket.v_heads, bucket.key, bucket.value
        k = rng.standard_normal((t, h, kd))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        arrays = dict(q=rng.standard_normal((t, h, kd)), k=k, v=rng.standard_normal((t, hv, vd)))
        arrays = {name: a.astype(dtype) for name, a in arrays.items()}
        arrays["g"] = _log_decays(rng, (t, hv, kd) if bucket.op == "kda" else (t, hv), strong=strong_decays)
        arrays["beta"] = rng.uniform(0.0, 1.0, (t, hv)).astype(np.float32)
        state = (hv, kd, vd)
    elif bucket.op == "ssd":
        h, groups, p, ns = bucket.heads, bucket.v_heads, bucket.key, bucket.value
        arrays = dict(x=rng.standard_normal((t, h, p)), B=rng.standard_normal((t, groups, ns)),
                      C=rng.standard_normal((t, groups, ns)))
        arrays = {name: a.astype(dtype) for name, a in arrays.items()}
        arrays["dt"] = (rng.standard_normal((t, h)) - 1).astype(np.float32)
        A = -rng.uniform(0.5, 2.0, h).astype(np.float32)
        if strong_decays:
            # a few tokens with delta = softplus(dt) of about 1e4 or 30: a per-token decay past the floor, or e^-15..-60
            hits = rng.random((t, h)) < 0.03
            arrays["dt"][hits] = rng.choice(np.array([1e4, 30.0], np.float32), size=int(hits.sum()))
            if rng.random() < 0.2:
                A[int(rng.integers(h))] = -np.inf
        params = dict(A=A)
        state = (h, p, ns)
    else:
        d, width = bucket.heads, bucket.key
        arrays = dict(x=rng.standard_normal((t, d)).astype(dtype))
        params = dict(weight=rng.standard_normal((d, width)).astype(np.float32),
                      bias=rng.standard_normal(d).astype(np.float32))
        state = (d, width - 1)
    for a in arrays.values():
        a[cu[-1]:] = np.nan
    initial = rng.standard_normal((n, *state)).astype(np.float32) * has_initial.reshape(-1, *([1] * len(state)))
    return Batch(bucket, arrays, params, initial, has_initial, cu, ccu, offsets)


def interpret_config(op: str, implementation: str):
    """The config that runs a Pallas implementation of `op` ("gdn", "kda", "ssd") in its interpreter (CPU)."""
    return (SSD_CONFIGS if op == "ssd" else DELTA_CONFIGS)[implementation](interpret=True)


def call(batch: Batch, implementation: str, *, arrays=None, initial_state=None, metadata=None, **options):
    """The public packed entry of the batch's op."""
    arrays = batch.arrays if arrays is None else arrays
    initial_state = batch.initial_state if initial_state is None else initial_state
    meta = batch.metadata() if metadata is None else metadata
    op = batch.bucket.op
    if op == "gdn":
        return ops.gated_delta_rule(**arrays, initial_state=initial_state, **meta, implementation=implementation,
                                    **options)
    if op == "kda":
        return ops.kda(**arrays, initial_state=initial_state, **meta, implementation=implementation, **options)
    if op == "ssd":
        a = arrays
        return ops.ssd(a["x"], a["dt"], batch.params["A"], a["B"], a["C"], initial_state=initial_state, **meta,
                       implementation=implementation, **options)
    return ops.causal_conv1d(arrays["x"], batch.params["weight"], batch.params["bias"], initial_state=initial_state,
                             **meta, implementation=implementation, **options)


def call_paged(batch: Batch, implementation: str, state_pool, *, initial_state_indices, has_initial_state,
               final_state_indices, checkpoint_state_indices, **options):
    """The public paged entry of the batch's op (the pool is not donated: the caller compares it afterwards)."""
    slots = dict(initial_state_indices=initial_state_indices, has_initial_state=has_initial_state,
                 final_state_indices=final_state_indices, checkpoint_state_indices=checkpoint_state_indices,
                 donate=False, implementation=implementation, **batch.metadata(), **options)
    a, op = batch.arrays, batch.bucket.op
    if op == "gdn":
        return ops.gated_delta_rule_paged(**a, state_pool=state_pool, **slots)
    if op == "kda":
        return ops.kda_paged(**a, state_pool=state_pool, **slots)
    if op == "ssd":
        return ops.ssd_paged(a["x"], a["dt"], batch.params["A"], a["B"], a["C"], state_pool, **slots)
    return ops.causal_conv1d_paged(a["x"], batch.params["weight"], state_pool, batch.params["bias"], **slots)


def errors(batch: Batch, result, reference) -> dict[str, float]:
    """rel-RMS of the real tokens' outputs, the final states and the real checkpoint states; NaN where non-finite."""
    t, m = batch.real_tokens, batch.real_checkpoints
    parts = dict(out=(result[0][:t], reference[0][:t]), final=(result[1], reference[1]),
                 checkpoints=(result[2][:m], reference[2][:m]))
    found = {}
    for name, (actual, expected) in parts.items():
        actual = np.asarray(actual, np.float64)
        found[name] = rel_rms(actual, expected) if np.isfinite(actual).all() else float("nan")
    return found
