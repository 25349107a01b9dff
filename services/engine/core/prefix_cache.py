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

Lookups walk a token trie (one per LoRA load), whose nodes know which
entries pass through them: a match costs one dict step per matched token,
whatever the number of entries (a scan of every entry, per sequence
admitted, would cost more than the prefill it saves once thousands of small
prompts fit in the bound). Entries are numbered, so the trie's sets hold
ints, not token tuples to hash.

The values are opaque (the engine stores per-layer tensors); this module
only keys, weighs, matches and evicts them, so it is tested without torch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    through: set[int] = field(default_factory=set)  # ids of the entries on this path
    ends: int | None = None  # the entry whose tokens end here


@dataclass
class _Entry(Generic[V]):
    lora_id: str | None
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
        self._entries: OrderedDict[int, _Entry[V]] = OrderedDict()  # oldest use first
        self._roots: dict[str | None, _Node] = {}  # one trie per LoRA load (None: base)
        self._next_id = 0
        self.nbytes = 0
        self.hits = 0  # lookups that matched at least one token
        self.lookups = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def _walk(self, lora_id: str | None, tokens: tuple[int, ...], limit: int) -> tuple[int, _Node]:
        """How far `tokens[:limit]` goes down the trie, and the node it reaches."""
        node = self._roots.get(lora_id)
        if node is None:
            return 0, _Node()
        depth = 0
        for tok in tokens[:limit]:
            child = node.children.get(tok)
            if child is None:
                break
            node, depth = child, depth + 1
        return depth, node

    def match(self, lora_id: str | None, tokens: tuple[int, ...], limit: int) -> Match[V]:
        """The longest cached prefix of `tokens` under `lora_id`, at most `limit` tokens
        long (the engine passes len - 1: the last prompt token is always computed, for
        its logits, as SGLang's `_compute_max_prefix_len` does)."""
        self.lookups += 1
        depth, node = self._walk(lora_id, tokens, max(limit, 0))
        if depth == 0:
            return Match(0, None)
        self.hits += 1
        entry_id = max(node.through)  # any entry on the path holds it; the newest
        self._entries.move_to_end(entry_id)
        return Match(depth, self._entries[entry_id].value)

    def covered(self, lora_id: str | None, tokens: tuple[int, ...]) -> bool:
        """Whether some entry already holds all of `tokens` (inserting them would add
        nothing); refreshes that entry."""
        depth, node = self._walk(lora_id, tokens, len(tokens))
        if depth < len(tokens) or not tokens:
            return False
        self._entries.move_to_end(max(node.through))
        return True

    def insert(self, lora_id: str | None, tokens: tuple[int, ...], value: V, nbytes: int) -> bool:
        """Store `value` (the KV of all of `tokens`); False when it is not stored (empty,
        larger than the capacity, or already covered by a longer entry). Entries that are
        prefixes of it are dropped (it holds their KV too); then the least recently used
        entries go until it fits."""
        if not tokens or nbytes > self.capacity or self.covered(lora_id, tokens):
            return False
        for prefix in self._prefix_entries(lora_id, tokens):
            self._drop(prefix)
        while self._entries and self.nbytes + nbytes > self.capacity:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        entry_id, self._next_id = self._next_id, self._next_id + 1
        node = self._roots.setdefault(lora_id, _Node())
        for tok in tokens:
            node = node.children.setdefault(tok, _Node())
            node.through.add(entry_id)
        node.ends = entry_id
        self._entries[entry_id] = _Entry(lora_id, tokens, value, nbytes)
        self.nbytes += nbytes
        return True

    def clear(self) -> int:
        """Drop every entry (a flush); the number dropped."""
        n = len(self._entries)
        self._entries.clear()
        self._roots.clear()
        self.nbytes = 0
        return n

    def _prefix_entries(self, lora_id: str | None, tokens: tuple[int, ...]) -> list[int]:
        node = self._roots.get(lora_id)
        found: list[int] = []
        for tok in tokens:
            if node is None:
                break
            node = node.children.get(tok)
            if node is not None and node.ends is not None:
                found.append(node.ends)
        return found

    def _drop(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.nbytes -= entry.nbytes
        node = self._roots[entry.lora_id]
        path = []
        for tok in entry.tokens:
            path.append((node, tok))
            node = node.children[tok]
            node.through.discard(entry_id)
        if node.ends == entry_id:
            node.ends = None
        for parent, tok in reversed(path):  # prune the branch no entry uses any more
            if parent.children[tok].through:
                break
            del parent.children[tok]
        if not self._roots[entry.lora_id].children:
            del self._roots[entry.lora_id]
