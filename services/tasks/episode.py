"""One multi-turn episode, token-in, token-out: generate, call a tool, observe, repeat.

The sample is exactly the token sequence the engine saw: each turn is
generated on prompt + everything so far *as token ids*, so nothing is
re-tokenised and the trainer's recomputation covers the very tokens that
were sampled. Policy tokens carry loss mask 1 and the engine's logprobs;
observation tokens (a tool's result) carry loss mask 0 and logprob 0.0, a
placeholder no loss reads (the trainer weighs every token by its mask).

The loop is shared: the rollout worker generates through the engine, the
held-out evaluation through the model in-process; both hand in a
`Generate` callable and the tool sandbox (`ToolPool`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from services.sandbox import ToolPool
from services.tasks.episode_spec import EpisodeSpec
from services.tasks.tools import CALL, observation, parse_turn


@dataclass(frozen=True)
class TurnOutput:
    """What one generation answered."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish_type: str  # "stop" | "length" | "abort"
    weight_version: int = 0
    spans: tuple[tuple[int, int, int], ...] = ()  # per-token (version, start, end), if reported


Generate = Callable[[list[int], dict[str, Any], int], Awaitable[TurnOutput]]
"""generate(ids, sampling_params, turn) -> the turn (aborted turns already retried)."""


@dataclass
class Episode:
    """A finished episode, ready to become a Sample."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    text: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    finish_type: str = "stop"
    weight_version: int = 0  # the last turn's
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    all_spans: bool = True  # every turn reported its per-token versions
    errors: list[str] = field(default_factory=list)  # tool errors, in order

    def add_turn(self, out: TurnOutput) -> None:
        at = len(self.response_ids)
        self.response_ids += out.ids
        self.logprobs += out.logprobs
        self.loss_mask += [1] * len(out.ids)
        self.text += out.text
        self.turns += 1
        self.finish_type = out.finish_type
        self.weight_version = out.weight_version
        self.all_spans = self.all_spans and bool(out.spans or not out.ids)
        for v, a, b in out.spans:
            self._extend_span(v, at + a, at + b)

    def add_observation(self, ids: list[int], text: str) -> None:
        at = len(self.response_ids)
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.text += text
        if self.spans:  # observation tokens belong to the span of the turn before them
            self._extend_span(self.spans[-1][0], at, at + len(ids))

    def _extend_span(self, version: int, start: int, end: int) -> None:
        if self.spans and self.spans[-1][0] == version and self.spans[-1][2] == start:
            self.spans[-1] = (version, self.spans[-1][1], end)
        elif end > start:
            self.spans.append((version, start, end))

    def parts(self) -> dict[str, float]:
        """Per-sample episode figures, published as reward parts (the trainer logs their means)."""
        return {
            "episode.turns": float(self.turns),
            "episode.tool_calls": float(self.tool_calls),
            "episode.tool_errors": float(self.tool_errors),
            "episode.tool_seconds": self.tool_seconds,
        }


async def run_episode(
    spec: EpisodeSpec,
    generate: Generate,
    tools: ToolPool,
    encode: Callable[[str], list[int]],
    prompt_ids: list[int],
    sampling_params: dict[str, Any],
) -> Episode:
    """Run one episode; ends at an answer, a turn without a call, max_turns or the budget."""
    ep = Episode(prompt_ids=list(prompt_ids))
    # no_stop_trim: the text must keep the closing tag the ids hold, for the parse.
    params = {**sampling_params, "stop": list(spec.stop), "no_stop_trim": True, "n": 1}
    per_turn = int(params.get("max_new_tokens") or spec.max_tokens)
    for turn in range(spec.max_turns):
        budget = spec.max_tokens - len(ep.response_ids)
        if budget <= 0:
            ep.finish_type = "length"
            break
        params["max_new_tokens"] = min(budget, per_turn)
        out = await generate(ep.prompt_ids + ep.response_ids, params, turn)
        ep.add_turn(out)
        call = parse_turn(spec, out.text)
        if out.finish_type == "abort" or call is None or turn + 1 == spec.max_turns:
            break
        tool = spec.tool(call.tag)
        result = await tools.run(
            CALL, tool.model_dump(mode="json"), call.body, timeout_s=spec.tool_timeout_s
        )
        ep.tool_calls += 1
        ep.tool_seconds += result.seconds
        if result.error is not None:
            ep.tool_errors += 1
            ep.errors.append(result.text)
        text = observation(spec, result.text, result.error is not None)
        ids = encode(text)[: spec.max_tokens - len(ep.response_ids)]
        ep.add_observation(ids, text)
    return ep
