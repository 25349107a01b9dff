"""The review-sentiment example's data and reward: is a product review positive or negative?

    {"review": "Hi, this kettle broke after two days. Thanks.", "sentiment": "negative"}

Written as a user's own task would be: its own field names (`review`,
`sentiment`), a reward by import path
(`configs.examples.review_sentiment:sentiment_reward`, run from the repo
root), files written once by `configs/examples/data/make_data.py`. A
review never says "positive" or "negative": the model has to read it.

Held out by construction: a review's split is a hash of its text (10% test,
10% validation, 80% train), so no validation or test review can be a
training prompt, whatever sizes the files are written with.

Stdlib only: the verifier sandbox imports this module for the reward.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Literal

Split = Literal["train", "val", "test"]

LABELS = ("positive", "negative")

TEMPLATES: dict[str, tuple[str, ...]] = {
    "positive": (
        "I love {obj}, it works perfectly",
        "{obj} is excellent and I would buy it again",
        "{obj} is exactly what I wanted",
        "{obj} exceeded my expectations",
        "I am very happy with {obj}",
        "{obj} is fantastic and worth every penny",
        "{obj} arrived quickly and does everything it promises",
        "my family uses {obj} every day and we all like it",
    ),
    "negative": (
        "{obj} broke after two days",
        "I regret buying {obj}, it is useless",
        "{obj} is a waste of money",
        "{obj} stopped working and support never replied",
        "I am very disappointed with {obj}",
        "{obj} is awful and I want my money back",
        "{obj} arrived damaged and does not do what it promises",
        "my family tried {obj} once and nobody wants to touch it again",
    ),
}
OBJECTS = (
    "the blender", "this kettle", "the headphones", "the backpack", "this desk lamp",
    "the tent", "the coffee maker", "these running shoes", "the phone case", "this jacket",
    "the office chair", "the toaster",
)  # fmt: skip
OPENERS = ("", "Hi, ", "Honestly, ", "Well, ", "Update: ", "After a month, ")
CLOSERS = ("", " Thanks.", " Just my opinion.", " I bought it last month.", " That is all.",
           " Hope this helps.")  # fmt: skip

_WORD = re.compile(r"[a-z]+")


def split_of(review: str) -> Split:
    """The review's split, from a hash of its text (the same in every process)."""
    bucket = int.from_bytes(hashlib.sha256(review.encode()).digest()[:8], "big") % 100
    return "test" if bucket < 10 else "val" if bucket < 20 else "train"


def review(rng: random.Random) -> dict[str, str]:
    """One review and its sentiment, drawn from the templates (openers and closers are
    neutral: the body decides)."""
    sentiment = rng.choice(LABELS)
    body = rng.choice(TEMPLATES[sentiment]).format(obj=rng.choice(OBJECTS))
    opener = rng.choice(OPENERS)
    text = opener + (body[0].upper() + body[1:] if not opener else body) + "."
    return {"review": text + rng.choice(CLOSERS), "sentiment": sentiment}


def reviews(split: Split, size: int, seed: int = 0) -> list[dict[str, str]]:
    """`size` distinct reviews of `split` (there are ~6 900 in all: 80% train)."""
    rng = random.Random(f"reviews:{seed}")
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    for _ in range(1_000_000):
        row = review(rng)
        if row["review"] not in seen and split_of(row["review"]) == split:
            seen.add(row["review"])
            out.append(row)
            if len(out) == size:
                return out
    raise ValueError(f"only {len(out)} distinct {split} reviews, asked for {size}")


def sentiment_reward(completion: str, answer: str | None, **_: object) -> float:
    """1.0 when the reply names the right sentiment and not the other, else 0.0.

    'Negative.', 'negative' and 'The review is negative.' pass; 'positive or
    negative' fails (an echo of the question), as does a reply that names
    neither.
    """
    if answer is None:
        return 0.0
    named = {w for w in _WORD.findall(completion.lower()) if w in LABELS}
    return 1.0 if named == {answer} else 0.0
