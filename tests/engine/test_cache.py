"""The align-mode prefix cache: publication only after writes, hit clamping, LRU eviction, accounting, pool errors."""

import numpy as np
import pytest

from jaxckpt.engine.cache import NULL_PAGE, PrefixCache, extend_block_hashes
from jaxckpt.plan import NULL_SLOT

B = 8


def _fill(cache, tokens, *, state_blocks):
    """Publishes a page per full block of `tokens` and a written state after each block in `state_blocks`."""
    hashes = cache.block_hashes(tokens)
    pages = [cache.allocate_page() for _ in hashes]
    for page, key in zip(pages, hashes):
        assert cache.publish_page(page, key)
    slots = [cache.reserve_slot(hashes[j]) for j in state_blocks]
    cache.commit(slots)
    cache.release_pages(pages)
    for slot in slots:
        cache.release_slot(slot)
    return pages, slots


def test_block_hashes_are_chained():
    rng = np.random.default_rng(11)
    a = rng.integers(0, 256, 5 * B).tolist()
    b = list(a)
    b[3] = (b[3] + 1) % 256
    ha = PrefixCache(block_size=B, num_kv_pages=4, num_state_slots=4).block_hashes(a)
    hb = extend_block_hashes([], b, block_size=B)
    assert len(ha) == 5 and len(set(ha)) == 5
    # a change in block 0 changes every later key, though blocks 1..4 hold the same tokens
    assert all(x != y for x, y in zip(ha, hb))
    # extending continues the chain where it stopped
    assert extend_block_hashes(ha[:2], a, block_size=B) == ha
    assert extend_block_hashes([], a[:5 * B - 1], block_size=B) == ha[:4]
    # num_tokens hashes the prefix without a copy of it, and only within the tokens given
    assert extend_block_hashes([], a, block_size=B, num_tokens=5 * B - 1) == ha[:4]
    assert extend_block_hashes(ha[:1], a, block_size=B, num_tokens=3 * B) == ha[:3]
    with pytest.raises(ValueError, match="num_tokens"):
        extend_block_hashes([], a, block_size=B, num_tokens=5 * B + 1)


def test_reserved_state_is_found_only_after_commit():
    rng = np.random.default_rng(12)
    tokens = rng.integers(0, 256, 3 * B + 5).tolist()
    cache = PrefixCache(block_size=B, num_kv_pages=8, num_state_slots=4)
    pages, _ = _fill(cache, tokens, state_blocks=[])
    hashes = cache.block_hashes(tokens)
    slot = cache.reserve_slot(hashes[1])
    assert slot != NULL_SLOT
    miss = cache.lookup(tokens)
    assert (miss.num_tokens, miss.pages, miss.state_slot) == (0, (), NULL_SLOT)
    assert miss.attention_tokens == 3 * B
    # a declined checkpoint: reserved with a key, never written, discarded -> nothing hashed, slot free again
    cache.discard([slot])
    assert not cache.published_state_keys()
    assert cache.slots.available == 3
    slot = cache.reserve_slot(hashes[1])
    assert cache.commit([slot]) == 1
    hit = cache.lookup(tokens)
    assert (hit.num_tokens, hit.pages, hit.state_slot) == (2 * B, tuple(pages[:2]), slot)


def test_hit_is_clamped_to_a_published_state_and_stops_before_the_last_token():
    rng = np.random.default_rng(13)
    tokens = rng.integers(0, 256, 4 * B).tolist()
    cache = PrefixCache(block_size=B, num_kv_pages=8, num_state_slots=8)
    pages, slots = _fill(cache, tokens, state_blocks=[0, 2, 3])
    # the state after 4 blocks exists, but a prompt of exactly 4 blocks recomputes its last token: hit at 3 blocks
    hit = cache.lookup(tokens)
    assert (hit.num_tokens, hit.pages, hit.state_slot, hit.attention_tokens) == (3 * B, tuple(pages[:3]),
                                                                                 slots[1], 3 * B)
    # a prompt that diverges inside block 2 matches pages 0..1 but only the state after block 0
    other = tokens[:2 * B + 3] + [(tokens[2 * B + 3] + 1) % 256] + tokens[2 * B + 4:]
    hit2 = cache.lookup(other + [7])
    assert (hit2.num_tokens, hit2.pages, hit2.state_slot, hit2.attention_tokens) == (B, (pages[0],), slots[0], 2 * B)
    stats = cache.stats
    assert (stats.lookups, stats.hit_requests, stats.hit_blocks) == (2, 2, 4)
    assert stats.hit_tokens == 4 * B and stats.attention_hit_tokens == 5 * B
    assert stats.query_tokens == 4 * B + 4 * B + 1
    assert stats.hit_rate == pytest.approx(4 * B / (8 * B + 1))


def test_lru_evicts_unreferenced_entries_oldest_first_and_never_referenced_ones():
    rng = np.random.default_rng(14)
    cache = PrefixCache(block_size=B, num_kv_pages=5, num_state_slots=3)
    first = rng.integers(0, 256, 2 * B + 1).tolist()
    second = rng.integers(0, 256, 2 * B + 1).tolist()
    pages1, slots1 = _fill(cache, first, state_blocks=[1])
    pages2, slots2 = _fill(cache, second, state_blocks=[1])
    assert cache.pages.available == 4 and cache.slots.available == 2
    # touching `first` makes `second` the least recently used
    hit = cache.lookup(first)
    assert hit.num_tokens == 2 * B
    cache.release_pages(hit.pages)
    cache.release_slot(hit.state_slot)
    # pages of `second` go first, tail page first (the chain is freed from its end)
    assert cache.allocate_page() == pages2[1]
    assert cache.allocate_page() == pages2[0]
    assert cache.stats.evicted_pages == 2
    assert cache.lookup(second).num_tokens == 0
    # a referenced entry is never evicted: hold `first`, the pool is exhausted
    held = cache.lookup(first)
    assert held.num_tokens == 2 * B
    with pytest.raises(ValueError, match=r"^num_kv_pages: .* needs 1"):
        cache.allocate_page()
    # the state of `second` is evictable (its slot), the held state of `first` is not
    assert cache.reserve_slot(None) == slots2[0]
    with pytest.raises(ValueError, match=r"^num_state_slots: "):
        cache.reserve_slot(None)
    assert cache.stats.evicted_slots == 1


def test_null_entries_are_never_handed_out_and_pools_report_their_size():
    cache = PrefixCache(block_size=B, num_kv_pages=6, num_state_slots=4)
    pages = [cache.allocate_page() for _ in range(5)]
    slots = [cache.reserve_slot(None) for _ in range(3)]
    assert sorted(pages) == [1, 2, 3, 4, 5] and NULL_PAGE not in pages
    assert sorted(slots) == [1, 2, 3] and NULL_SLOT not in slots
    with pytest.raises(ValueError, match=r"^num_kv_pages: the pool has 5 usable pages .* needs 3"):
        cache.ensure(pages=3)
    with pytest.raises(ValueError, match=r"^num_state_slots: "):
        cache.ensure(slots=1)
    for bad, name in ((dict(num_kv_pages=1, num_state_slots=4), "num_kv_pages"),
                      (dict(num_kv_pages=4, num_state_slots=1), "num_state_slots"),
                      (dict(num_kv_pages=4, num_state_slots=0), "num_state_slots")):
        with pytest.raises(ValueError, match=f"^{name}: "):
            PrefixCache(block_size=B, **bad)


def test_a_duplicate_write_stays_private_and_is_freed():
    rng = np.random.default_rng(15)
    tokens = rng.integers(0, 256, 2 * B + 1).tolist()
    cache = PrefixCache(block_size=B, num_kv_pages=8, num_state_slots=4)
    _, (canonical,) = _fill(cache, tokens, state_blocks=[1])
    key = cache.block_hashes(tokens)[1]
    again = cache.reserve_slot(key)
    assert cache.commit([again]) == 0
    cache.release_slot(again)
    assert again in cache.slots.free and cache.lookup(tokens).state_slot == canonical
