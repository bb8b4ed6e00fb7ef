"""Align-mode prefix cache: attention KV pages keyed by content, recurrent-state slots keyed by block boundary.

A simplified model of vLLM's align mode (hash unit = block size B). Block j of a sequence is keyed by a chained hash
of its tokens and every earlier block. Attention keeps one KV page per full block; the recurrent layers keep one
state slot per *published* boundary: the slot keyed by block j holds the state after (j + 1)·B tokens. Only states
that a forward actually wrote are published (a slot is reserved with its key before the step and committed after
it), so a declined checkpoint can never be found by a later lookup: a reserved-and-hashed but unwritten slot would
poison the cache.

A hit must end on a boundary whose recurrent state is published; attention hits are clamped to it, as vLLM's
coordinator intersects the groups' hits. Page 0 and slot 0 are the null page and the null slot, never handed out.
Unreferenced published entries are evicted least recently used first.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import numpy as np

from jaxckpt.plan import NULL_SLOT, checkpoint_position
from jaxckpt.plan.conventions import check_positive

NULL_PAGE = 0


def extend_block_hashes(hashes: list[bytes], tokens: Sequence[int], *, block_size: int,
                        num_tokens: int | None = None) -> list[bytes]:
    """Appends, in place, the chained hash of every full block of `tokens[:num_tokens]` (all of `tokens` for None)
    that `hashes` does not cover yet; `num_tokens` spares a caller the copy of a prefix on every engine step."""
    if num_tokens is None:
        num_tokens = len(tokens)
    elif not 0 <= num_tokens <= len(tokens):
        raise ValueError(f"num_tokens: must be in [0, {len(tokens)}] (the tokens given), got {num_tokens}")
    for j in range(len(hashes), num_tokens // block_size):
        block = np.asarray(tokens[j * block_size:(j + 1) * block_size], np.int64).tobytes()
        parent = hashes[j - 1] if j else b""
        hashes.append(hashlib.blake2b(parent + block, digest_size=16).digest())
    return hashes


@dataclasses.dataclass
class CacheStats:
    """Lookup accounting; `attention_hit_tokens` is what the attention pages alone would have matched."""

    lookups: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0
    hit_requests: int = 0
    attention_hit_tokens: int = 0
    evicted_pages: int = 0
    evicted_slots: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    num_tokens: int            # multiple of the block size; the request resumes from here
    pages: tuple[int, ...]     # KV pages of the hit blocks (referenced for the caller)
    state_slot: int            # state after num_tokens tokens (referenced for the caller); NULL_SLOT on a miss
    attention_tokens: int      # the attention-only match before clamping to a published state


class _Pool:
    """Ids 1..size-1 with reference counts. Published ids carry a key; unreferenced published ids wait in LRU order
    and are evicted when the free list runs dry; unreferenced unpublished ids return to the free list."""

    def __init__(self, size: int, *, name: str, unit: str):
        self.name, self.unit, self.size = name, unit, size
        self.free: deque[int] = deque(range(1, size))
        self.refs: dict[int, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.by_key: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    @property
    def available(self) -> int:
        return len(self.free) + len(self.lru)

    def ensure(self, count: int):
        if count > self.available:
            raise ValueError(
                f"{self.name}: the pool has {self.size - 1} usable {self.unit}s (entry 0 is null) and {self.available} "
                f"free or evictable; this step needs {count}. Raise {self.name}.")

    def allocate(self) -> int:
        self.ensure(1)
        if self.free:
            entry = self.free.popleft()
        else:
            entry, _ = self.lru.popitem(last=False)
            del self.by_key[self.key_of.pop(entry)]
            self.evictions += 1
        self.refs[entry] = 1
        return entry

    def find(self, key: bytes) -> int | None:
        return self.by_key.get(key)

    def ref(self, entry: int):
        self.lru.pop(entry, None)
        self.refs[entry] = self.refs.get(entry, 0) + 1

    def release(self, entry: int):
        count = self.refs[entry] - 1
        if count:
            self.refs[entry] = count
            return
        del self.refs[entry]
        if entry in self.key_of:
            self.lru[entry] = None
        else:
            self.free.append(entry)

    def publish(self, entry: int, key: bytes) -> bool:
        """Keys `entry` unless the key is already published (the first copy stays canonical, this one stays private)."""
        if entry not in self.refs:
            raise ValueError(f"{self.name}: {self.unit} {entry} is not allocated")
        if key in self.by_key or entry in self.key_of:
            return False
        self.key_of[entry] = key
        self.by_key[key] = entry
        return True


class PrefixCache:
    """KV-page and state-slot pools of one engine, with align-mode prefix matching.

    `num_kv_pages` and `num_state_slots` are the pool sizes including the null entry 0.
    """

    def __init__(self, *, block_size: int, num_kv_pages: int, num_state_slots: int):
        self.block_size = check_positive(block_size, name="block_size")
        if check_positive(num_kv_pages, name="num_kv_pages") < 2:
            raise ValueError(f"num_kv_pages: needs at least 2 (page 0 is the null page), got {num_kv_pages}")
        if check_positive(num_state_slots, name="num_state_slots") < 2:
            raise ValueError(f"num_state_slots: needs at least 2 (slot 0 is the null slot), got {num_state_slots}")
        self.pages = _Pool(num_kv_pages, name="num_kv_pages", unit="page")
        self.slots = _Pool(num_state_slots, name="num_state_slots", unit="slot")
        self._pending: dict[int, bytes | None] = {}
        self._stats = CacheStats()

    @property
    def stats(self) -> CacheStats:
        return dataclasses.replace(self._stats, evicted_pages=self.pages.evictions,
                                   evicted_slots=self.slots.evictions)

    def block_hashes(self, tokens: Sequence[int]) -> list[bytes]:
        return extend_block_hashes([], tokens, block_size=self.block_size)

    def lookup(self, tokens: Sequence[int], *, hashes: Sequence[bytes] | None = None, record: bool = True) -> PrefixHit:
        """Longest cached prefix of `tokens` that ends on a published state; references what it returns.

        The prompt's last token is always recomputed (its logits are needed), so the hit stops at or before the last
        block boundary strictly below the prompt length. With `record=False` the lookup is not counted in `stats`
        (an admission that may be undone: `release_hit`, or `record_lookup` once the request is admitted).
        """
        limit = checkpoint_position(len(tokens), self.block_size) // self.block_size
        if hashes is None:
            hashes = self.block_hashes(tokens[:limit * self.block_size])
        pages = []
        for key in hashes[:limit]:
            page = self.pages.find(key)
            if page is None:
                break
            pages.append(page)
        attention_blocks = len(pages)
        num_blocks, slot = attention_blocks, NULL_SLOT
        while num_blocks:
            found = self.slots.find(hashes[num_blocks - 1])
            if found is not None:
                slot = found
                break
            num_blocks -= 1
        pages = pages[:num_blocks]
        for page in pages:
            self.pages.ref(page)
        if slot != NULL_SLOT:
            self.slots.ref(slot)
        hit = PrefixHit(num_blocks * self.block_size, tuple(pages), slot, attention_blocks * self.block_size)
        if record:
            self.record_lookup(hit, num_query_tokens=len(tokens))
        return hit

    def record_lookup(self, hit: PrefixHit, *, num_query_tokens: int):
        stats = self._stats
        stats.lookups += 1
        stats.query_tokens += num_query_tokens
        stats.hit_tokens += hit.num_tokens
        stats.hit_blocks += hit.num_tokens // self.block_size
        stats.hit_requests += hit.num_tokens > 0
        stats.attention_hit_tokens += hit.attention_tokens

    def release_hit(self, hit: PrefixHit):
        """Drops the references a lookup took (a request that was not admitted after all)."""
        self.release_pages(hit.pages)
        self.release_slot(hit.state_slot)

    @property
    def available_pages(self) -> int:
        """Pages that can be allocated now: free, or published and unreferenced (evicted on allocation)."""
        return self.pages.available

    @property
    def available_slots(self) -> int:
        return self.slots.available

    def ensure(self, *, pages: int = 0, slots: int = 0):
        """Raises ValueError naming the pool when a step's allocations cannot fit even after evicting everything."""
        self.pages.ensure(pages)
        self.slots.ensure(slots)

    def allocate_page(self) -> int:
        return self.pages.allocate()

    def publish_page(self, page: int, key: bytes) -> bool:
        """Keys a page whose block the forward has completely written."""
        return self.pages.publish(page, key)

    def release_pages(self, pages: Iterable[int]):
        """Drops one reference from each page, tail first, so a freed chain is evicted from its end."""
        for page in reversed(list(pages)):
            self.pages.release(page)

    def reserve_slot(self, key: bytes | None) -> int:
        """A fresh slot that a forward will write; it becomes findable under `key` only through `commit`."""
        slot = self.slots.allocate()
        self._pending[slot] = key
        return slot

    def commit(self, slots: Iterable[int]) -> int:
        """The forward wrote these reserved slots: publish the ones reserved with a key; returns how many were new."""
        published = 0
        for slot in slots:
            key = self._pending.pop(slot)
            if key is not None:
                published += self.slots.publish(slot, key)
        return published

    def discard(self, slots: Iterable[int]):
        """Reserved slots whose forward did not run: unkeyed, back to the free list."""
        for slot in slots:
            del self._pending[slot]
            self.slots.release(slot)

    def release_slot(self, slot: int):
        if slot != NULL_SLOT:
            self.slots.release(slot)

    def is_published(self, key: bytes) -> bool:
        return self.slots.find(key) is not None

    def published_state_keys(self) -> set[bytes]:
        return set(self.slots.by_key)
