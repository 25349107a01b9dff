"""Write the example's GSM8K-format word problems (seeded, so the files are reproducible).

    python configs/examples/data/make_word_problems.py

Each line is {"question": "...", "answer": "<worked solution>\\n#### <number>"},
the GSM8K layout, written by this script from templates (no GSM8K text).
The numbers are small and the templates few, so the tiny model of
`flywheel init-model` can learn some of them on a CPU.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Cleo", "Dev", "Ema", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]
ITEMS = ["apples", "books", "coins", "pencils", "shells", "stamps", "cards", "marbles"]


def problem(rng: random.Random) -> dict[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(1, 9)
    kind = rng.randrange(5)
    if kind == 0:
        q = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"
        s, n = f"{name} has {a} + {b} = {a + b} {item}.", a + b
    elif kind == 1:
        a, b = max(a, b), min(a, b)
        q = f"{name} had {a} {item} and gave {b} away. How many {item} are left?"
        s, n = f"{a} - {b} = {a - b} {item} are left.", a - b
    elif kind == 2:
        a = rng.randint(2, 9)
        q = f"A box holds {a} {item}. How many {item} are in {c} boxes?"
        s, n = f"{c} boxes hold {c} * {a} = {c * a} {item}.", c * a
    elif kind == 3:
        q = f"{name} has {a} {item}, finds {b} more and loses {c}. How many {item} now?"
        s, n = f"{a} + {b} = {a + b}, and {a + b} - {c} = {a + b - c}.", a + b - c
    else:
        q = f"{name} and a friend have {a} {item} each. How many {item} do they have together?"
        s, n = f"2 * {a} = {2 * a} {item}.", 2 * a
    return {"question": q, "answer": f"{s}\n#### {n}"}


def write(path: Path, n: int, seed: int, avoid: set[str]) -> set[str]:
    rng, seen = random.Random(seed), set()
    with path.open("w") as f:
        while len(seen) < n:
            p = problem(rng)
            if p["question"] in avoid or p["question"] in seen:
                continue
            seen.add(p["question"])
            f.write(json.dumps(p) + "\n")
    return seen


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    train = write(here / "word-problems-train.jsonl", 400, seed=1, avoid=set())
    write(here / "word-problems-test.jsonl", 100, seed=2, avoid=train)  # disjoint questions
