"""Held-out evaluation of a task with episodes: the same turn loop, the model in-process.

Each held-out row runs `episode.run_episode` (the rollout worker's loop) with
greedy generation by the model itself instead of an engine. The episodes
run concurrently and `Batcher` gathers the turns that are waiting into one
batched `generate`, so a turn of every row costs one forward pass per token,
as single-turn evaluation does. Tools run in the evaluation's `ToolPool`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from services.runtime.threads import Offload
from services.sandbox import ToolPool
from services.tasks.episode import Episode, TurnOutput, run_episode
from services.tasks.episode_spec import EpisodeSpec


def cut_at_stop(tokenizer: Any, ids: list[int], stop: tuple[str, ...]) -> tuple[list[int], str]:
    """The generated ids up to and with EOS or the first stop string, and their text."""
    eos = tokenizer.eos_token_id
    for n in range(1, len(ids) + 1):
        if ids[n - 1] == eos:
            return ids[:n], tokenizer.decode(ids[:n], skip_special_tokens=True)
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        if any(text.endswith(s) for s in stop):
            return ids[:n], text
    return ids, tokenizer.decode(ids, skip_special_tokens=True)


def generate_turns(
    model: Any, tokenizer: Any, prompts: list[list[int]], max_new: list[int], stop: tuple[str, ...]
) -> list[tuple[list[int], str, str]]:
    """One greedy turn per prompt, stopped at EOS or a stop string: (ids, text, finish)."""
    import torch

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(max_new),
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
            do_sample=False,
            stop_strings=list(stop),
            tokenizer=tokenizer,
        )
    out = []
    for row, limit in zip(gen[:, width:].tolist(), max_new, strict=True):
        got, text = cut_at_stop(tokenizer, row[:limit], stop)
        stopped = len(got) < limit or any(text.endswith(s) for s in stop)
        stopped = stopped or (bool(got) and got[-1] == tokenizer.eos_token_id)
        out.append((got, text, "stop" if stopped else "length"))
    return out


class Batcher:
    """A `Generate` for run_episode: turns waiting at the same moment share one batch."""

    BATCH = 64  # rows per generate, as evaluate.generate

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stop: tuple[str, ...],
        offload: Offload = asyncio.to_thread,
    ) -> None:
        self.model, self.tokenizer, self.stop = model, tokenizer, stop
        self.offload = offload
        self.waiting: list[tuple[list[int], int, asyncio.Future[TurnOutput]]] = []
        self.lock = asyncio.Lock()

    async def __call__(self, ids: list[int], params: dict[str, Any], turn: int) -> TurnOutput:
        fut: asyncio.Future[TurnOutput] = asyncio.get_running_loop().create_future()
        self.waiting.append((ids, int(params["max_new_tokens"]), fut))
        await asyncio.sleep(0)  # let the other episodes that are ready queue their turn
        async with self.lock:
            if not fut.done():
                batch, self.waiting = self.waiting, []
                outs = []
                for i in range(0, len(batch), self.BATCH):
                    chunk = batch[i : i + self.BATCH]
                    outs += await self.offload(
                        generate_turns,
                        self.model,
                        self.tokenizer,
                        [b[0] for b in chunk],
                        [b[1] for b in chunk],
                        self.stop,
                    )
                for (_, _, f), (got, text, finish) in zip(batch, outs, strict=True):
                    f.set_result(TurnOutput(got, [0.0] * len(got), text, finish))
        return await fut


async def run_episodes(
    model: Any,
    tokenizer: Any,
    spec: EpisodeSpec,
    prompts: list[list[int]],
    max_new_tokens: int,
    tools: ToolPool,
    offload: Offload = asyncio.to_thread,
) -> list[Episode]:
    """One greedy episode per prompt (the model's own turns, the tools' observations)."""
    was_training = model.training
    model.eval()
    batcher = Batcher(model, tokenizer, spec.stop, offload)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    params = {"max_new_tokens": max_new_tokens}
    try:
        return list(
            await asyncio.gather(
                *(run_episode(spec, batcher, tools, encode, p, params) for p in prompts)
            )
        )
    finally:
        model.train(was_training)
