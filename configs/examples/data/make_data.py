"""Write the examples' JSONL files from their generators (seeded, so they are reproducible).

    python configs/examples/data/make_data.py

For each example, <name>-train.jsonl (2000 rows), <name>-val.jsonl (150) and
<name>-test.jsonl (300): tickets-*.jsonl, one {"ticket": ..., "department": ...}
per line (configs/examples/ticket_routing.py), and reviews-*.jsonl, one
{"review": ..., "sentiment": ...} per line (configs/examples/review_sentiment.py).
A row's split is a hash of its text, so an example's three files share no row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repo root: `configs.examples` imports

from configs.examples.review_sentiment import reviews  # noqa: E402
from configs.examples.ticket_routing import tickets  # noqa: E402

SIZES = {"train": 2000, "val": 150, "test": 300}
EXAMPLES = {"tickets": tickets, "reviews": reviews}


def main() -> None:
    for name, rows in EXAMPLES.items():
        for split, n in SIZES.items():
            path = HERE / f"{name}-{split}.jsonl"
            with path.open("w") as f:
                for row in rows(split, n):  # type: ignore[arg-type]
                    f.write(json.dumps(row) + "\n")
            print(f"{path}: {n} rows")


if __name__ == "__main__":
    main()
