"""The prefix cache's bookkeeping (pure): longest common prefix, LoRA keys, LRU by bytes."""

from __future__ import annotations

import pytest

from services.engine.core.prefix_cache import PrefixCache


def test_match_is_the_longest_common_prefix_capped_at_the_limit() -> None:
    cache: PrefixCache[str] = PrefixCache(100)
    cache.insert(None, (1, 2, 3, 4), "A", 10)
    cache.insert(None, (1, 2, 9), "B", 10)
    # Not a whole entry: the KV of an entry's first k tokens serves any query sharing them.
    m = cache.match(None, (1, 2, 3, 7, 7), limit=10)
    assert (m.length, m.value) == (3, "A")
    assert cache.match(None, (1, 2, 9, 9), limit=10).value == "B"
    # The limit (len - 1: the last token is always computed) caps a whole-prompt hit.
    assert cache.match(None, (1, 2, 3, 4), limit=3).length == 3
    assert cache.match(None, (5, 6), limit=1).value is None
    assert cache.match(None, (1, 2, 3), limit=0).length == 0


def test_an_adapter_load_is_its_own_namespace() -> None:
    cache: PrefixCache[str] = PrefixCache(100)
    cache.insert("lora-a", (1, 2, 3), "A", 10)
    assert cache.match(None, (1, 2, 3, 4), limit=3).value is None
    assert cache.match("lora-b", (1, 2, 3, 4), limit=3).value is None
    assert cache.match("lora-a", (1, 2, 3, 4), limit=3).value == "A"


def test_a_longer_entry_absorbs_its_prefixes_and_a_covered_one_adds_nothing() -> None:
    cache: PrefixCache[str] = PrefixCache(100)
    assert cache.insert(None, (1, 2), "short", 10)
    assert cache.insert(None, (1, 2, 3, 4), "long", 20)
    assert len(cache) == 1 and cache.nbytes == 20  # (1, 2) is inside (1, 2, 3, 4)
    assert not cache.insert(None, (1, 2, 3), "inside", 15)
    assert cache.covered(None, (1, 2, 3)) and not cache.covered(None, (1, 3))


def test_full_evicts_the_least_recently_used_and_refuses_what_never_fits() -> None:
    cache: PrefixCache[str] = PrefixCache(30)
    for i in range(3):
        cache.insert(None, (i, 0), f"e{i}", 10)
    cache.match(None, (0, 0, 5), limit=2)  # e0 used: e1 is now the oldest
    assert cache.insert(None, (3, 0), "e3", 10)
    assert cache.evictions == 1 and cache.nbytes == 30
    assert cache.match(None, (1, 0, 5), limit=2).value is None
    assert cache.match(None, (0, 0, 5), limit=2).value == "e0"
    assert not cache.insert(None, (4, 0), "huge", 31)  # larger than the whole bound
    assert len(cache) == 3 and cache.nbytes <= cache.capacity


def test_an_evicted_entry_leaves_the_prefix_it_shared_to_the_others() -> None:
    cache: PrefixCache[str] = PrefixCache(20)
    cache.insert(None, (1, 2, 3), "A", 10)
    cache.insert(None, (1, 2, 4), "B", 10)
    cache.insert(None, (9,), "C", 10)  # A, the oldest, goes
    assert cache.match(None, (1, 2, 3, 5), limit=4) == cache.match(None, (1, 2, 9), limit=3)
    m = cache.match(None, (1, 2, 3, 5), limit=4)
    assert (m.length, m.value) == (2, "B")
    cache.insert(None, (7,), "D", 10)  # C goes (B was just used)
    cache.insert(None, (8,), "E", 10)  # B goes: nothing is left on (1, 2)
    assert len(cache) == 2
    assert cache.match(None, (1, 2, 3), limit=3).length == 0
    assert not cache.covered(None, (1,))


def test_many_entries_match_in_one_walk() -> None:
    """Thousands of prompts: a lookup follows the query's tokens, not every entry."""
    cache: PrefixCache[int] = PrefixCache(10**9)
    for i in range(5000):
        cache.insert(None, (7, 7, i // 100, i % 100, 1, 2, 3), i, 100)
    assert len(cache) == 5000
    m = cache.match(None, (7, 7, 42, 17, 1, 2, 9), limit=6)
    assert (m.length, m.value) == (6, 4217)


def test_clear_and_disabled() -> None:
    cache: PrefixCache[str] = PrefixCache(30)
    cache.insert(None, (1, 2), "x", 10)
    assert cache.clear() == 1 and len(cache) == 0 and cache.nbytes == 0
    off: PrefixCache[str] = PrefixCache(0)
    assert not off.enabled and not off.insert(None, (1,), "x", 1)
    with pytest.raises(ValueError, match="capacity"):
        PrefixCache(-1)
