"""The task of the real-model demo: name the last word of a list.

"What is the last word in this list: chair, ladder, fish?" -> "fish".
SmolLM2-135M-Instruct answers in a sentence ('The last word in this list
is "fish."') and, on lists of 7 to 12 nouns, names the wrong word about
three times in four. `names_the_word` scores a reply right when it names
the answer and no other of the task's nouns, in a sentence or bare: one
part, so there is no shaped credit for the policy to settle on below the
answer. `brevity_credit` is the earlier demo's shaped part (the bare word
by exact_match, a sentence paid less the longer it is), which left one run
in three on "The last word: X"; the LoRA and distillation examples still
use it. bench/results_demo_real.md: how the task, its prompt, reward and
learning rate were chosen by measurement, and what failed.

Splits are disjoint by construction: a list's split is decided by a hash
of the list itself (10% test, 10% validation, 80% train), so a held-out
list can never be a training prompt, whatever the seeds and sizes. The
space is 120 nouns in lists of 3 to 8 (~10^16 lists): a run sees a few
hundred of them.

Pure and stdlib-only: the verifier sandbox's children import it (the
reward) and the buffer calls `rows` (a `type = "function"` source).
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Literal

Split = Literal["train", "val", "test"]

NOUNS = (
    "apple bread chair cloud dog eagle fish garden house island jacket kite lamp mountain "
    "night ocean pencil queen river stone table umbrella village window yard zebra anchor "
    "basket candle desert engine forest guitar hammer igloo jungle kettle ladder mirror "
    "needle orange pillow rabbit saddle tiger violin wagon bottle button castle dragon "
    "feather ghost honey iron jelly lemon magnet nest onion pepper rocket spoon tomato "
    "wallet whale bridge camera cookie doctor farmer hat king letter monkey nurse parrot "
    "planet robot sailor snake teacher train wizard yogurt beach cabin flower glass horse "
    "moon paper shirt sugar tent cow drum lion shoe bell coat ship tree card bird frog "
    "star hill road sock ring boat door cake milk duck wolf fox owl"
).split()

_WORD = re.compile(r"[A-Za-z]+")


def split_of(words: list[str]) -> Split:
    """The list's split, from a hash of the list itself (the same in every process)."""
    digest = hashlib.sha256(",".join(words).encode()).digest()
    bucket = int.from_bytes(digest[:8], "big") % 100
    return "test" if bucket < 10 else "val" if bucket < 20 else "train"


def question(words: list[str]) -> str:
    return f"What is the last word in this list: {', '.join(words)}?"


def rows(
    split: Split = "train",
    size: int = 20_000,
    seed: int = 0,
    min_words: int = 3,
    max_words: int = 8,
) -> list[dict[str, str]]:
    """`size` rows {"prompt", "answer"} of `split`, drawn with a seeded RNG.

    Held-out splits are distinct lists; the training split may repeat one
    (it is sampled, like any generator's).
    """
    if split not in ("train", "val", "test"):
        raise ValueError(f"split must be train, val or test, not {split!r}")
    rng = random.Random(f"last-word:{split}:{seed}")
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(out) < size:
        words = [rng.choice(NOUNS) for _ in range(rng.randint(min_words, max_words))]
        key = ",".join(words)
        if split_of(words) != split or (split != "train" and key in seen):
            continue
        seen.add(key)
        out.append({"prompt": question(words), "answer": words[-1]})
    return out


def brevity_credit(completion: str, answer: str | None, *, top: float = 0.5) -> float:
    """Partial credit for the right word ending a longer reply, less the longer it is.

    0 when the reply is exactly the word (the exact_match part pays that)
    or does not end with it; else `top` for a two-word reply down to
    top/5 from eleven words on. 'The last word in this list is "fish."'
    (8 words) earns 0.15, 'The answer is fish.' 0.35: a group's shorter
    right replies beat its longer ones, so the policy walks from a sentence
    to the bare word (measured: without this part the bare word was never
    sampled and the exact reward never paid, bench/results_demo_real.md).
    """
    if answer is None:
        return 0.0
    text = completion.strip()
    words = _WORD.findall(text)
    if not words or words[-1] != answer or _first_line(text) == answer:
        return 0.0
    return top * max(0.2, 1.0 - (len(text.split()) - 1) / 10)


def _first_line(text: str) -> str:
    """What the exact_match part compares (its first_line extraction, normalised)."""
    return re.sub(r"\s+", " ", text.split("\n", 1)[0].strip()).strip("$ ").rstrip(".").strip()


_NOUN_SET = frozenset(NOUNS)


def names_the_word(completion: str, answer: str | None) -> float:
    """1 when the reply names the answer and no other noun of the task, else 0.

    The reply may say it in a sentence ('The last word in this list is
    fish.') or bare ('fish'); echoing the list, or hedging between two of
    its words, names more than one and scores 0.
    """
    if answer is None:
        return 0.0
    named = {w.lower() for w in _WORD.findall(completion)} & _NOUN_SET
    return 1.0 if named == {answer} else 0.0
