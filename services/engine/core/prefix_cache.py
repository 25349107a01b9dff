"""The CPU engine's prefix cache: prompts' KV, matched by their longest common prefix (pure).

Why. A group's n samples share their prompt, and a rollout worker sends
them as one request: without a cache the engine prefilled that prompt n
times. SGLang keeps every computed prefix in a radix tree and a request
reuses the longest one it matches; this is the same contract at CPU scale.

What it stores. An entry is one token sequence (under one LoRA load: the
key's `lora_id`, as SGLang's `extra_key`) and its KV for every position.
Because attention is causal, the KV of an entry's first k tokens is the KV
of any sequence that starts with those k tokens, so a lookup returns the
entry with the longest common prefix with the query (not only an entry
that is a whole prefix of it): the radix tree's answer, without its
sharing of storage. Storage is de-duplicated where one entry is a prefix
of another (the longer one replaces or absorbs it), which is the common
case: a prompt, then prompt + reply, then the next turn.

Bounds. Entries are weighed in bytes (the KV they hold) and the cache keeps
at most `capacity` bytes: inserting past it evicts the least recently used
entries (a hit refreshes an entry) until the new one fits; an entry larger
than the whole capacity is not stored. Running sequences hold their own
copy of the KV, so an eviction never touches a request in flight (SGLang
cannot evict a prefix a running request holds; here nothing is shared to
protect). Capacity 0 is the cache switched off (SGLang's
`--disable-radix-cache`).

The values are opaque (the engine stores per-layer tensors); this module
only keys, weighs, matches and evicts them, so it is tested without torch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")

Key = tuple[str | None, tuple[int, ...]]
"""(lora_id, token ids): the same tokens under another adapter are another prefix."""


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token tuples (binary search over
    slice equality, which compares in C: O(n log n) element compares, no Python loop
    per token)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo], a[:hi + 1] != b[:hi + 1] when hi < n
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class Entry(Generic[V]):
    tokens: tuple[int, ...]
    value: V
    nbytes: int


@dataclass(frozen=True)
class Match(Generic[V]):
    """A lookup's answer: the first `length` positions of `value` are the query's KV."""

    length: int
    value: V | None


class PrefixCache(Generic[V]):
    """LRU map of (lora_id, tokens) -> KV, answering longest-common-prefix lookups."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[Key, Entry[V]] = OrderedDict()  # oldest use first
        self.nbytes = 0
        self.hits = 0  # lookups that matched at least one token
        self.lookups = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, lora_id: str | None, tokens: tuple[int, ...], limit: int) -> Match[V]:
        """The longest cached prefix of `tokens` under `lora_id`, at most `limit` tokens
        long (the engine passes len - 1: the last prompt token is always computed, for
        its logits, as SGLang's `_compute_max_prefix_len` does)."""
        self.lookups += 1
        best: tuple[int, Key] | None = None
        if limit > 0:
            for key, entry in self._entries.items():
                if key[0] != lora_id:
                    continue
                n = min(common_prefix(entry.tokens, tokens), limit)
                if n > 0 and (best is None or n > best[0]):
                    best = (n, key)
        if best is None:
            return Match(0, None)
        self.hits += 1
        self._entries.move_to_end(best[1])
        return Match(best[0], self._entries[best[1]].value)

    def covered(self, lora_id: str | None, tokens: tuple[int, ...]) -> bool:
        """Whether some entry already holds all of `tokens` (inserting them would add
        nothing); refreshes that entry."""
        for key, entry in self._entries.items():
            if key[0] == lora_id and entry.tokens[: len(tokens)] == tokens:
                self._entries.move_to_end(key)
                return True
        return False

    def insert(self, lora_id: str | None, tokens: tuple[int, ...], value: V, nbytes: int) -> bool:
        """Store `value` (the KV of all of `tokens`); False when it is not stored (empty,
        larger than the capacity, or already covered by a longer entry). Entries that are
        prefixes of it are dropped (it holds their KV too); then the least recently used
        entries go until it fits."""
        if not tokens or nbytes > self.capacity or self.covered(lora_id, tokens):
            return False
        for key in [
            k
            for k, e in self._entries.items()
            if k[0] == lora_id and tokens[: len(e.tokens)] == e.tokens
        ]:
            self._drop(key)
        while self._entries and self.nbytes + nbytes > self.capacity:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        self._entries[(lora_id, tokens)] = Entry(tokens, value, nbytes)
        self.nbytes += nbytes
        return True

    def clear(self) -> int:
        """Drop every entry (a flush); the number dropped."""
        n = len(self._entries)
        self._entries.clear()
        self.nbytes = 0
        return n

    def _drop(self, key: Key) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
