"""The running rows: sequences aligned with one left-padded KV cache, stepped together.

The scheduler decides *which* sequences run; this owns *how*: a batched
prefill that samples each newcomer's first token and joins its cache rows
(`kvbatch.join`), one decode step for every row, and dropping rows that
finished. Split from the scheduler so each reads on its own.

With the prefix cache on (`core/prefix_cache.py`), a newcomer's prefill
starts from the longest cached prefix of its tokens (at most all but the
last, whose logits it needs) and computes only the rest (`runner.extend`).
Newcomers that share a prompt (a request's n samples, identical prompts in
flight) first have that prompt computed once, as SGLang's tokenizer manager
sends an n > 1 request's prompt ahead of its samples; each sample then
computes one token on top of it. What a prefill computed is cached.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.engine.core import kvbatch
from services.engine.core.prefix_cache import PrefixCache
from services.engine.core.sampling import sample_rows, uniform_noise
from services.engine.core.sequence import Seq, stop_reason

if TYPE_CHECKING:
    import torch

    from services.engine.runner import ModelRunner

Finish = Callable[[Seq, dict[str, Any]], None]
"""Called with a sequence that ended and its finish reason."""


def _params(seqs: list[Seq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch

    ps = [s.spec.params for s in seqs]
    return (
        torch.tensor([p.temperature for p in ps], dtype=torch.float32),
        torch.tensor([p.top_p for p in ps], dtype=torch.float32),
        torch.tensor([p.top_k for p in ps], dtype=torch.long),
    )


def _match_limit(seq: Seq, length: int) -> int:
    """How much of a sequence's `length` tokens may come from the cache: all but the last
    (its logits are computed), and none past `logprob_start_len` when it asks for prompt
    logprobs (SGLang's `Req._compute_max_prefix_len`)."""
    limit = length - 1
    if seq.spec.input_start is not None:
        limit = min(limit, seq.spec.input_start)
    return max(limit, 0)


class Batch:
    """Running sequences (`seqs`, row-aligned with `kv`) and the sampler's shared state."""

    def __init__(
        self,
        runner: ModelRunner,
        eos: frozenset[int],
        decode: Callable[[list[int], bool], str],
        random_seed: int,
        prefix_cache_bytes: int = 0,
    ) -> None:
        import torch

        self.runner = runner
        self.eos = eos
        self.decode_text = decode
        self.seqs: list[Seq] = []
        self.kv: kvbatch.KVBatch | None = None
        self._params: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._shared_gen = torch.Generator().manual_seed(random_seed)
        self.generated_tokens = 0  # monotonic counter, read by /v1/loads
        self.last_output = 0.0  # time.time() of the last sampled token
        self.prefix_cache: PrefixCache[kvbatch.Layers] = PrefixCache(prefix_cache_bytes)

    def used_tokens(self) -> int:
        kv = self.kv
        return int(kv.lengths.sum()) if kv is not None else 0

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (order preserved)."""
        self.seqs = [self.seqs[i] for i in rows]
        self.kv = kvbatch.select(self.kv, rows) if self.kv is not None else None
        self._params = None
        self.runner.invalidate()

    def clear(self) -> list[Seq]:
        """Drop every row and its cache (a retraction: they re-prefill later)."""
        seqs, self.seqs, self.kv, self._params = self.seqs, [], None, None
        self.runner.invalidate()
        return seqs

    def admit(self, new: list[Seq], finish: Finish) -> None:
        """Prefill `new` (a retracted sequence re-prefills prompt + its tokens), sample their
        first token, and join the ones that go on."""
        import torch

        for seq in new:
            if seq.generator is None and seq.spec.params.sampling_seed is not None:
                seq.generator = torch.Generator().manual_seed(seq.spec.params.sampling_seed)
        if self.prefix_cache.enabled:
            logits, kv = self._prefill_cached(new)
        else:
            logits, kv = self.runner.prefill(
                [list(s.spec.input_ids) + s.output_ids for s in new],
                [s.spec.lora_id for s in new],
            )
        alive = self._sample(logits, new, _params(new), finish)
        if not alive:
            return
        joining = kvbatch.select(kv, alive)
        assert joining is not None
        self.kv = kvbatch.join(self.kv, joining)
        self.seqs.extend(new[i] for i in alive)
        self._params = None
        self.runner.invalidate()

    # ---- the prefix cache ------------------------------------------------------------

    def _prefill_cached(self, new: list[Seq]) -> tuple[torch.Tensor, kvbatch.KVBatch]:
        """`runner.prefill` of `new` through the prefix cache: shared prompts first, once,
        then every row from its longest cached prefix. Same logits and KV, within float
        rounding; each sequence learns how many of its tokens came from the cache."""
        rows = [(s.spec.lora_id, tuple(s.spec.input_ids) + tuple(s.output_ids)) for s in new]
        limits = [_match_limit(s, len(t)) for s, (_, t) in zip(new, rows, strict=True)]
        scratch: PrefixCache[kvbatch.Layers] = PrefixCache(1 << 62)  # this admission's own
        self._compute_shared(new, rows, limits, scratch)
        logits, kv, matched = self._extend(rows, limits, scratch)
        for seq, n in zip(new, matched, strict=True):
            if seq.cached_tokens is None:
                seq.cached_tokens = n
        return logits, kv

    def _compute_shared(
        self,
        new: list[Seq],
        rows: list[tuple[str | None, tuple[int, ...]]],
        limits: list[int],
        scratch: PrefixCache[kvbatch.Layers],
    ) -> None:
        """Compute once each prefix that several newcomers (or an n > 1 request's samples)
        will read and the cache lacks: every such row then starts from it."""
        groups: dict[tuple[str | None, tuple[int, ...]], int] = {}
        many: set[tuple[str | None, tuple[int, ...]]] = set()
        for seq, (lora, tokens), limit in zip(new, rows, limits, strict=True):
            key = (lora, tokens[:limit])
            groups[key] = groups.get(key, 0) + 1
            if seq.spec.params.n > 1:
                many.add(key)
        shared = [
            key
            for key, count in groups.items()
            if len(key[1]) > 0
            and (count > 1 or key in many)
            and not self.prefix_cache.covered(key[0], key[1])
        ]
        if shared:
            self._extend(shared, [len(t) - 1 for _, t in shared], scratch)

    def _extend(
        self,
        rows: list[tuple[str | None, tuple[int, ...]]],
        limits: list[int],
        scratch: PrefixCache[kvbatch.Layers],
    ) -> tuple[torch.Tensor, kvbatch.KVBatch, list[int]]:
        """Prefill `rows` from their longest cached prefixes (at most `limits`); cache what
        was computed, also in `scratch` (kept for this admission even when the cache
        cannot hold it); return logits [B, V], the rows' KV and each row's cached length."""
        found = []
        for (lora, tokens), limit in zip(rows, limits, strict=True):
            a = self.prefix_cache.match(lora, tokens, limit)
            b = scratch.match(lora, tokens, limit)
            found.append(b if b.length > a.length else a)
        suffixes = [list(t[m.length :]) for (_, t), m in zip(rows, found, strict=True)]
        loras = [lora for lora, _ in rows]
        if all(m.length == 0 for m in found):
            logits, kv = self.runner.prefill(suffixes, loras)
        else:
            past = kvbatch.stack_prefixes([(m.value, m.length) for m in found])
            logits, kv = self.runner.extend(past, suffixes, loras)
        for row, ((lora, tokens), m) in enumerate(zip(rows, found, strict=True)):
            if m.length < len(tokens) and not self.prefix_cache.covered(lora, tokens):
                layers = kvbatch.row_prefix(kv, row)
                size = kvbatch.nbytes(layers)
                self.prefix_cache.insert(lora, tokens, layers, size)
                scratch.insert(lora, tokens, layers, size)
        return logits, kv, [m.length for m in found]

    def decode(self, finish: Finish) -> None:
        """One decode step for every row; rows that finished leave."""
        import torch

        assert self.kv is not None
        last = torch.tensor([s.output_ids[-1] for s in self.seqs], dtype=torch.long)
        logits = self.runner.decode(self.kv, last, [s.spec.lora_id for s in self.seqs])
        if self._params is None:
            self._params = _params(self.seqs)
        alive = self._sample(logits, self.seqs, self._params, finish)
        if len(alive) != len(self.seqs):
            self.keep(alive)

    def _sample(
        self, logits: torch.Tensor, seqs: list[Seq], params: Any, finish: Finish
    ) -> list[int]:
        """Sample one token per row, append token + logprob; return rows that go on."""
        temperature, top_p, top_k = params
        noise = uniform_noise(
            logits.shape[0], logits.shape[1], self._shared_gen, [s.generator for s in seqs]
        )
        tokens, logprobs = sample_rows(logits, temperature, top_p, top_k, noise)
        self.last_output = time.time()
        alive: list[int] = []
        for row, (seq, tok, lp) in enumerate(
            zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            seq.output_ids.append(tok)
            seq.logprobs.append(lp)
            reason, matched = stop_reason(seq, self.eos, self.decode_text)
            if reason is None:
                alive.append(row)
            else:
                seq.matched_str = matched
                finish(seq, reason)
        self.generated_tokens += len(seqs)
        return alive
