"""How a row becomes a prompt and then token ids: one function for training and evaluation.

The buffer formats each row (`format_row`: system prompt, template) into
the PromptTask it dispatches; the rollout worker and the evaluation turn
that prompt into ids with `encode` (the tokenizer's chat template when the
task asks for it), so what a model is evaluated on is what it trained on.
"""

from __future__ import annotations

from typing import Any

from services.tasks.sources import Row
from services.tasks.spec import TaskSpec

Messages = tuple[dict[str, str], ...]


def format_row(spec: TaskSpec, row: Row) -> tuple[str | None, Messages | None]:
    """(prompt, messages) to send: exactly one of them is not None."""
    if row.messages is not None:
        msgs = row.messages
        if spec.system_prompt and not any(m.get("role") == "system" for m in msgs):
            msgs = ({"role": "system", "content": spec.system_prompt}, *msgs)
        return None, msgs
    text = spec.prompt_template.format(prompt=row.prompt or "")
    if spec.system_prompt:
        return None, (
            {"role": "system", "content": spec.system_prompt},
            {"role": "user", "content": text},
        )
    return text, None


def readable(prompt: str | None, messages: Messages | None) -> str:
    """A prompt as a person reads it: its text, or its chat turns as `role: content` lines."""
    if messages is None:
        return prompt or ""
    return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in messages)


def encode(
    tokenizer: Any, prompt: str | None, messages: Messages | None, chat_template: bool = True
) -> list[int]:
    """Token ids of a prompt: chat messages through the template, plain text as it is
    unless `chat_template` asks to wrap it as one user turn (and the tokenizer has one)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if messages is None and not (chat_template and has_template):
        return list(tokenizer(prompt or "", add_special_tokens=False)["input_ids"])
    if messages is None:
        messages = ({"role": "user", "content": prompt or ""},)
    elif not has_template:
        raise ValueError("chat messages need a tokenizer with a chat template")
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def sft_messages(spec: TaskSpec, row: Row) -> list[dict[str, str]]:
    """The row as a chat to fine-tune on: its prompt, then its solution as the reply."""
    prompt, messages = format_row(spec, row)
    turns = list(messages) if messages is not None else [{"role": "user", "content": prompt or ""}]
    return [*turns, {"role": "assistant", "content": row.solution or row.answer or ""}]
