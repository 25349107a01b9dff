"""SFT data: JSONL reading and tokenisation (arithmetic records: tasks/arithmetic_sft.py).

Two record shapes, one per line:

- chat: {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}
  rendered with the tokenizer's chat template; only assistant turns are
  trained on. A turn's span is found in the rendered *text* (the template
  applied to the conversation so far, with the generation prompt, is a
  prefix of the template applied through that turn) and mapped to tokens
  by their character offsets, so any template and any fast tokenizer work
  without re-tokenising prefixes.
- completion: {"prompt": "...", "completion": "..."}; the completion and an
  EOS token are trained on. A multi-turn trace gives the completion as
  segments, `[{"text": "<calc>2*3</calc>"}, {"text": "<result>6</result>",
  "train": false}, {"text": "<answer>6</answer>"}]`: each segment is
  tokenised on its own, as the rollout worker tokenises an episode (the
  policy's turns as generated, each tool observation encoded apart), and a
  segment with `"train": false` (an observation the policy did not write)
  has loss mask 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from services.runtime.errors import FlywheelError
from services.trainer.trainer import SftExample


class SftDataError(FlywheelError, ValueError):
    """A JSONL record is malformed; names the file and line."""

    def __init__(self, message: str, *, path: Path, line: int):
        super().__init__(f"{path}:{line}: {message}")
        self.path = path
        self.line = line


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    p = Path(path)
    with open(p) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SftDataError(f"invalid JSON: {e}", path=p, line=n) from e
            if not isinstance(rec, dict):
                raise SftDataError("a record must be a JSON object", path=p, line=n)
            yield n, rec


def _assistant_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple]]:
    """Rendered text of the conversation and the character spans of assistant turns."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        start_text = (
            tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            if i
            else ""
        )
        if not upto.startswith(start_text) or not text.startswith(upto):
            raise ValueError("chat template is not prefix-stable; cannot locate assistant turn")
        spans.append((len(start_text), len(upto)))
    return text, spans


def tokenize_chat(tokenizer: Any, messages: list[dict[str, str]]) -> SftExample:
    text, spans = _assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [
        1 if any(s <= start < e for s, e in spans) and end > start else 0
        for start, end in enc["offset_mapping"]
    ]
    return SftExample(torch.tensor(enc["input_ids"]), torch.tensor(mask))


def _segments(completion: object) -> list[tuple[str, bool]]:
    """(text, trained) of a completion: one string, or a list of segments."""
    if not isinstance(completion, list):
        return [(str(completion), True)]
    if not completion:
        raise ValueError("'completion' must be a string or a non-empty list of segments")
    out = []
    for i, seg in enumerate(completion):
        if not isinstance(seg, dict) or not isinstance(seg.get("text"), str):
            raise ValueError(f"completion segment {i} must be an object with a string 'text'")
        if not isinstance(seg.get("train", True), bool):
            raise ValueError(f"completion segment {i}: 'train' must be true or false")
        out.append((seg["text"], seg.get("train", True)))
    return out


def tokenize_completion(tokenizer: Any, prompt: str, completion: object) -> SftExample:
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    for text, trained in _segments(completion):
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids, mask = ids + seg, mask + [int(trained)] * len(seg)
    ids, mask = [*ids, tokenizer.eos_token_id], [*mask, 1]
    return SftExample(torch.tensor(ids), torch.tensor(mask))


def load_sft_file(path: str | Path, tokenizer: Any, max_len: int | None = None) -> list[SftExample]:
    """Tokenised examples of a JSONL file (chat or prompt/completion records)."""
    out = []
    for n, rec in read_jsonl(path):
        try:
            if "messages" in rec:
                ex = tokenize_chat(tokenizer, rec["messages"])
            elif "prompt" in rec and "completion" in rec:
                ex = tokenize_completion(tokenizer, str(rec["prompt"]), rec["completion"])
            else:
                raise ValueError("need 'messages' or 'prompt' and 'completion'")
        except (ValueError, TypeError, KeyError) as e:
            raise SftDataError(str(e), path=Path(path), line=n) from e
        if max_len is not None:
            ex = SftExample(ex.input_ids[:max_len], ex.loss_mask[:max_len])
        if int(ex.loss_mask[1:].sum()) == 0:
            continue  # nothing to learn from (e.g. truncated away)
        out.append(ex)
    if not out:
        raise SftDataError("no trainable examples", path=Path(path), line=0)
    return out
