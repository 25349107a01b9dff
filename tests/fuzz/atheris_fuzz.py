"""Coverage-guided fuzzing of one target with atheris (libFuzzer) — not run in CI.

    .venv/bin/pip install atheris        # a wheel exists for CPython 3.11 on x86-64 Linux
    .venv/bin/python -m tests.fuzz.atheris_fuzz decode_SampleGroup -max_total_time=60
    .venv/bin/python -m tests.fuzz.atheris_fuzz --list

The targets and their allowed errors are tests/fuzz/fuzz_targets.py's, the
same as the hypothesis tests'; the target's seeds are written to a corpus
directory (`-corpus DIR`, default a temporary one) so libFuzzer starts from
valid inputs. An undocumented exception is a crash: libFuzzer prints the
traceback and writes the input to `crash-<sha1>` in the working directory.
Any libFuzzer flag passes through (`-runs=N`, `-max_len=4096`, `-jobs=2`).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path


def main(argv: list[str]) -> int:
    import atheris

    with atheris.instrument_imports():
        from tests.fuzz.fuzz_targets import TARGETS, check

    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__)
        print("targets:", " ".join(sorted(TARGETS)))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in TARGETS:
        print(f"unknown target {name!r}; one of: {' '.join(sorted(TARGETS))}", file=sys.stderr)
        return 2
    target = TARGETS[name]
    corpus = Path(tempfile.mkdtemp(prefix=f"flywheel-atheris-{name}-"))
    if "-corpus" in rest:
        i = rest.index("-corpus")
        corpus = Path(rest[i + 1])
        rest = rest[:i] + rest[i + 2 :]
        corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(target.seeds):
        (corpus / f"seed-{i}").write_bytes(seed)

    def one_input(data: bytes) -> None:
        check(target, data)

    atheris.Setup([sys.argv[0], *rest, str(corpus)], one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
