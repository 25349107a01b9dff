"""Write the ticket-routing example's files (seeded, so they are reproducible).

    python configs/examples/data/make_tickets.py

tickets-train.jsonl (2000 messages), tickets-val.jsonl (150) and
tickets-test.jsonl (300), one {"ticket": ..., "department": ...} per line,
from configs/examples/ticket_routing.py's templates. A message's split is a
hash of its text, so the three files share no message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repo root: `configs.examples` imports

from configs.examples.ticket_routing import tickets  # noqa: E402

SIZES = {"train": 2000, "val": 150, "test": 300}


def main() -> None:
    for split, n in SIZES.items():
        path = HERE / f"tickets-{split}.jsonl"
        with path.open("w") as f:
            for row in tickets(split, n):  # type: ignore[arg-type]
                f.write(json.dumps(row) + "\n")
        print(f"{path}: {n} messages")


if __name__ == "__main__":
    main()
