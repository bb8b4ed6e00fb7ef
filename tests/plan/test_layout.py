"""Chunk and split planners: every token placed once, grids anchored at row starts, checkpoints located exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt.plan import bucket_size, chunk_layout, max_chunks, split_layout


def random_batch(rng, num_rows, max_len, max_ckpt, padding=0):
    lengths = rng.integers(0, max_len, num_rows)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    rows = []
    for length in lengths:
        k = min(int(rng.integers(0, max_ckpt + 1)), max(int(length) - 1, 0))
        rows.append(np.sort(rng.choice(np.arange(1, length), k, replace=False)) if k else np.zeros(0, int))
    ccu = np.concatenate([[0], np.cumsum([r.size for r in rows])]).astype(np.int32)
    offsets = np.concatenate(rows + [np.zeros(padding, int)]).astype(np.int32)
    return cu, ccu, offsets, int(cu[-1]) + int(rng.integers(0, 5))


@pytest.mark.parametrize("forced_breaks", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_chunk_layout_places_every_token_once(seed, forced_breaks):
    rng = np.random.default_rng(seed)
    chunk = int(rng.choice([4, 8, 16]))
    cu, ccu, offsets, num_tokens = random_batch(rng, int(rng.integers(1, 6)), 40, 3, padding=int(rng.integers(0, 3)))
    lay = chunk_layout(cu, ccu, offsets, chunk_size=chunk, num_tokens=num_tokens, forced_breaks=forced_breaks)
    nc = max_chunks(num_tokens, cu.size - 1, offsets.size, chunk, forced_breaks=forced_breaks)
    assert lay.chunk_len.shape == (nc,)
    seen = set()
    for c in range(nc):
        for p in range(lay.chunk_len[c]):
            token = lay.chunk_start[c] + p
            assert lay.token_chunk[token] == c and lay.token_pos[token] == p
            seen.add(int(token))
        if lay.chunk_len[c]:
            row = lay.chunk_row[c]
            assert cu[row] <= lay.chunk_start[c] and lay.chunk_start[c] + lay.chunk_len[c] <= cu[row + 1]
            assert lay.chunk_first[c] == (c == lay.row_first_chunk[row])
            assert lay.row_first_chunk[row] <= c < lay.row_first_chunk[row] + lay.row_num_chunks[row]
            if not forced_breaks:
                assert (lay.chunk_start[c] - cu[row]) % chunk == 0
    assert seen == set(range(int(cu[-1])))
    assert not lay.token_valid[cu[-1]:].any() and lay.token_valid[:cu[-1]].all()
    for n in range(cu.size - 1):
        assert lay.row_num_chunks[n] == (0 if cu[n] == cu[n + 1] else lay.row_num_chunks[n])
        starts = lay.chunk_start[lay.row_first_chunk[n]:lay.row_first_chunk[n] + lay.row_num_chunks[n]]
        assert np.all(np.diff(starts) > 0)
    for j in range(offsets.size):
        if j >= ccu[-1]:
            assert not lay.checkpoint_valid[j]
            continue
        row = lay.checkpoint_row[j]
        assert ccu[row] <= j < ccu[row + 1]
        c = lay.checkpoint_chunk[j]
        assert lay.chunk_row[c] == row and lay.chunk_len[c] > 0
        assert lay.chunk_start[c] + lay.checkpoint_pos[j] == cu[row] + offsets[j]
        if forced_breaks:
            assert lay.checkpoint_pos[j] == 0


@pytest.mark.parametrize("forced_breaks", [False, True])
def test_chunk_layout_traced_equals_host(forced_breaks):
    rng = np.random.default_rng(11)
    cu, ccu, offsets, num_tokens = random_batch(rng, 4, 30, 3, padding=2)
    host = chunk_layout(cu, ccu, offsets, chunk_size=8, num_tokens=num_tokens, forced_breaks=forced_breaks)
    traced = jax.jit(lambda a, b, c: chunk_layout(a, b, c, chunk_size=8, num_tokens=num_tokens,
                                                  forced_breaks=forced_breaks, xp=jnp))(cu, ccu, offsets)
    for name, a, b in zip(host._fields, host, traced):
        np.testing.assert_array_equal(a, np.asarray(b), err_msg=name)


@pytest.mark.parametrize("seed", range(5))
def test_split_layout_reassembles_rows_and_names_checkpoints(seed):
    rng = np.random.default_rng(100 + seed)
    cu, ccu, offsets, _ = random_batch(rng, int(rng.integers(1, 6)), 40, 3)
    launches = split_layout(cu, ccu, offsets)
    assert len(launches) == int(np.diff(ccu).max()) + 1
    pieces = {n: [] for n in range(cu.size - 1)}
    for j, launch in enumerate(launches):
        assert launch.cu_seqlens[-1] == launch.token_indices.size
        for i, row in enumerate(launch.rows):
            segment = launch.token_indices[launch.cu_seqlens[i]:launch.cu_seqlens[i + 1]]
            pieces[int(row)].append(segment)
            ckpt = launch.checkpoint_ids[i]
            if ckpt >= 0:
                # this launch's final state of the row is the state after its first offsets[ckpt] tokens
                assert ccu[row] + j == ckpt
                assert segment[-1] + 1 == cu[row] + offsets[ckpt]
            else:
                assert j == ccu[row + 1] - ccu[row]
    for n, segs in pieces.items():
        np.testing.assert_array_equal(np.concatenate(segs), np.arange(cu[n], cu[n + 1]))


def test_bucket_size():
    assert [bucket_size(n) for n in (0, 1, 16, 17, 1000)] == [16, 16, 16, 32, 1024]
    with pytest.raises(ValueError, match="n:"):
        bucket_size(-1)
