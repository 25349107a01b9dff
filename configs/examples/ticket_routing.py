"""The ticket-routing example's data and reward: route a customer message to a department.

    {"ticket": "Hi, the blender has not arrived yet. Please help.", "department": "shipping"}

Four departments (billing, shipping, returns, technical); a message never
names its department, so the model has to read it. Written as a user's own
task would be: its own field names (`ticket`, `department`), a reward by
import path (`configs.examples.ticket_routing:department_reward`, run from
the repo root), files written once by `configs/examples/data/make_data.py`.

Held out by construction: a message's split is a hash of its text (10%
test, 10% validation, 80% train), so no validation or test message can be a
training prompt, whatever sizes the files are written with.

Stdlib only: the verifier sandbox imports this module for the reward.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Literal

Split = Literal["train", "val", "test"]

DEPARTMENTS = ("billing", "shipping", "returns", "technical")

ISSUES: dict[str, tuple[str, ...]] = {
    "billing": (
        "I was charged twice for {obj}",
        "the invoice for {obj} shows the wrong amount",
        "my card was billed again after I cancelled {obj}",
        "I paid more for {obj} than the advertised price",
        "I need a receipt for {obj} for my taxes",
        "there is a payment for {obj} on my statement that I do not recognise",
    ),
    "shipping": (
        "{obj} has not arrived yet",
        "the tracking page for {obj} has not updated in a week",
        "{obj} was delivered to the wrong address",
        "the courier left {obj} at my neighbour's door without telling me",
        "{obj} has been stuck at the depot for days",
        "the delivery of {obj} is two weeks late",
    ),
    "returns": (
        "{obj} is the wrong size and I want to send it back",
        "I would like to exchange {obj} for a different colour",
        "how do I send back {obj} and get my money back",
        "I changed my mind about {obj} and want to return it",
        "I need a return label for {obj}",
        "{obj} is not what I expected, can I hand it back at a store",
    ),
    "technical": (
        "the app crashes whenever I open the page for {obj}",
        "the website shows an error when I try to buy {obj}",
        "the password reset email never arrives, so I cannot see {obj}",
        "the app freezes on the checkout screen with {obj} in my cart",
        "the product page of {obj} will not load on my phone",
        "I get logged out every time I add {obj} to my wishlist",
    ),
}
OBJECTS = (
    "my order", "the blender", "the winter jacket", "the headphones", "the desk lamp",
    "the phone case", "the coffee maker", "the running shoes", "the backpack", "the kettle",
    "the office chair", "the tent",
)  # fmt: skip
OPENERS = ("", "Hi, ", "Hello, ", "Good morning, ", "Hi there, ", "Dear support, ")
CLOSERS = ("", " Please help.", " Thanks.", " What should I do?", " Can you look into it?",
           " This is urgent.")  # fmt: skip

_WORD = re.compile(r"[a-z]+")


def split_of(ticket: str) -> Split:
    """The message's split, from a hash of its text (the same in every process)."""
    bucket = int.from_bytes(hashlib.sha256(ticket.encode()).digest()[:8], "big") % 100
    return "test" if bucket < 10 else "val" if bucket < 20 else "train"


def ticket(rng: random.Random) -> dict[str, str]:
    """One message and its department, drawn from the templates."""
    department = rng.choice(DEPARTMENTS)
    issue = rng.choice(ISSUES[department]).format(obj=rng.choice(OBJECTS))
    opener = rng.choice(OPENERS)
    text = opener + (issue[0].upper() + issue[1:] if not opener else issue) + "."
    return {"ticket": text + rng.choice(CLOSERS), "department": department}


def tickets(split: Split, size: int, seed: int = 0) -> list[dict[str, str]]:
    """`size` distinct messages of `split` (there are ~10 000 in all: 80% train)."""
    rng = random.Random(f"tickets:{seed}")
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    for _ in range(1_000_000):
        row = ticket(rng)
        if row["ticket"] not in seen and split_of(row["ticket"]) == split:
            seen.add(row["ticket"])
            out.append(row)
            if len(out) == size:
                return out
    raise ValueError(f"only {len(out)} distinct {split} messages, asked for {size}")


def department_reward(completion: str, answer: str | None, **_: object) -> float:
    """1.0 when the reply names the right department and no other, else 0.0.

    'Shipping.', 'shipping' and 'This goes to the shipping department.' all
    pass; 'billing or shipping' fails, as does a reply that names none. A
    reply that lists the departments fails: with 1.0 for the first one
    named, SmolLM2 learned to echo the prompt's list ('... billing,
    shipping, returns or technical'), right on every billing message and
    wrong on the rest (bench/results_learning.md).
    """
    if answer is None:
        return 0.0
    named = {w for w in _WORD.findall(completion.lower()) if w in DEPARTMENTS}
    return 1.0 if named == {answer} else 0.0
