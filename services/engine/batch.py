"""The running rows: sequences aligned with one left-padded KV cache, stepped together.

The scheduler decides *which* sequences run; this owns *how*: a batched
prefill that samples each newcomer's first token and joins its cache rows
(`kvbatch.join`), one decode step for every row, and dropping rows that
finished. Split from the scheduler so each reads on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.engine.core import kvbatch
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


class Batch:
    """Running sequences (`seqs`, row-aligned with `kv`) and the sampler's shared state."""

    def __init__(
        self,
        runner: ModelRunner,
        eos: frozenset[int],
        decode: Callable[[list[int], bool], str],
        random_seed: int,
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
        logits, kv = self.runner.prefill(
            [list(s.spec.input_ids) + s.output_ids for s in new], [s.spec.lora_id for s in new]
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
