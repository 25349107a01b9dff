"""A recorded sample as a flat row: its text, tokens, logprobs, reward and versions.

The row is what `replay export` writes and `replay rescore` scores. Text is
decoded from the recorded token ids with the run's tokenizer the way the
engine decodes a completion (special tokens skipped): the wire carries
token ids, not text (proto/messages.py `Sample`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from proto.messages import SampleGroup, unpack_f32, unpack_i32, unpack_u8

Decode = Callable[[list[int]], str]


def parse_task_id(task_id: str) -> tuple[int, int] | None:
    """(epoch, position) of the buffer's deterministic task id `<run>:e<epoch>:i<position>`
    (proto/README.md), None for another form."""
    parts = task_id.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].startswith("e") or not parts[2].startswith("i"):
        return None
    epoch, pos = parts[1][1:], parts[2][1:]
    return (int(epoch), int(pos)) if epoch.isdigit() and pos.isdigit() else None


def rows_of(
    seq: int, g: SampleGroup, decode: Decode, trained_step: int | None
) -> list[dict[str, Any]]:
    """One row per sample of group `g` (stream sequence `seq`)."""
    out = []
    for s in g.samples:
        prompt, response = unpack_i32(s.prompt_ids).tolist(), unpack_i32(s.response_ids).tolist()
        mask = unpack_u8(s.loss_mask)
        out.append(
            {
                "run": g.run,
                "stream_seq": seq,
                "group_id": g.group_id,
                "sample_id": s.sample_id,
                "task_id": s.task_id,
                "task_name": g.task_name,
                "index": s.index,
                "prompt": decode(prompt),
                "completion": decode(response),
                "prompt_ids": prompt,
                "response_ids": response,
                "logprobs": unpack_f32(s.logprobs).tolist(),
                "loss_mask": mask.tolist(),
                "env_tokens": int((mask == 0).sum()),  # observation tokens of an episode
                "reward": s.reward,
                "reward_parts": json.dumps(s.reward_parts, sort_keys=True),
                "verifier_error": s.verifier_error,
                "finish_reason": str(s.finish_reason),
                "weight_version": s.weight_version,
                "weight_version_last": s.weight_version_last,
                "engine_id": s.engine_id,
                "trained_step": trained_step,
            }
        )
    return out


def tokenizer_decode(model: Any) -> Decode:
    """The run's tokenizer's decode, as the engine decodes a completion."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    return lambda ids: str(tok.decode(ids, skip_special_tokens=True))
