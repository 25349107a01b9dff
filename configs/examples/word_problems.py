"""The word-problems example's reward: the reply's final number is the answer.

    {"question": "Gus had 16 cards and gave 2 away. How many cards are left?",
     "answer": "16 - 2 = 14 cards are left.\\n#### 14"}

GSM8K's layout (configs/examples/data/make_word_problems.py writes it from
templates); the run file's `answer_marker = "####"` hands the reward the text
after the marker. Written as a user would write a reward for their own data: a
function by import path (`configs.examples.word_problems:final_number`, run from
the repo root), stdlib only (the verifier sandbox imports it).

The last number in the reply is its answer, as a person reads a worked
solution ("16 - 2 = 14, so 14 cards are left." → 14); a reply with no number
scores 0. Nothing pays a format or a partial answer, so no plateau sits below
the answer.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def final_number(completion: str, answer: str | None, **_: object) -> float:
    """1.0 when the last number in the reply equals `answer`, else 0.0."""
    if answer is None:
        return 0.0
    found = _NUMBER.findall(completion)
    if not found:
        return 0.0
    try:
        return 1.0 if float(found[-1].replace(",", "")) == float(answer.replace(",", "")) else 0.0
    except ValueError:  # an answer that is no number: nothing equals it
        return 0.0
