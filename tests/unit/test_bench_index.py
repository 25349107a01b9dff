"""bench/README.md indexes every figure the docs cite from bench/, and names only what exists.

The rule: everything README.md and the guides in docs/ cite from bench/ is indexed.

- a citation is a path to a markdown file under bench/, as a link
  (`[..](../bench/results_x.md#section)`) or written out (`bench/results_x.md`);
  it is indexed when a row of the index's "Figures" table links that file and,
  when the citation names a section (#anchor), that very section;
- every row of that table is whole: a command that names an existing script (or a
  `make`/`flywheel` command), a date, the commits that recorded it (which this
  checkout's history holds), a machine and a results link;
- every link of the index resolves to a file, its #anchor to a heading there; every
  script it names exists, and every removed probe it names is recoverable from
  the commit it gives (`git show COMMIT:bench/NAME.py`);
- every bench/ script or results file that the docs, the services, the tests, the
  Makefile, CI or a bench script mention exists (a moved or removed one updates its
  references).

Scripts and results files the index does not list are allowed (engineers add them as
they measure); a figure becomes the index's business when a doc cites it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.harness import REPO
from tests.unit.test_docs import anchors

BENCH = REPO / "bench"
INDEX = BENCH / "README.md"
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
# A path into bench/ as text: `bench/x`, `../bench/x`; not `tests/integration/bench/x`
# and not `COMMIT:bench/x` (git's name of a file at a commit, e.g. a removed probe).
BENCH_PATH = re.compile(r"(?:(?<=\.\./)|(?<![\w:./-]))bench/([\w./-]*\w)(?:#([\w-]+))?")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")
RECOVERABLE = re.compile(r"git show ([0-9a-f]{7,40}):(bench/[\w./-]+)")


def rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def section(md: Path, title: str) -> str:
    """The text under `## title` up to the next `## ` heading."""
    text = md.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the markdown tables in `text`, as lists of cells."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or re.fullmatch(r"[|\-: ]+", line):
            continue
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows[1:]  # the header


def figure_rows() -> list[list[str]]:
    return table_rows(section(INDEX, "Figures"))


def target(link: str, base: Path) -> tuple[Path, str]:
    path, _, anchor = link.partition("#")
    return (base / path).resolve() if path else base, anchor


def indexed() -> set[tuple[Path, str]]:
    """(file, anchor) of every results link in the Figures table; anchor "" for a whole file."""
    return {target(m.group(1), BENCH) for row in figure_rows() for m in LINK.finditer(row[-1])}


def citations() -> list[tuple[str, Path, str]]:
    """(citing doc, bench file, anchor) of every markdown file under bench/ a doc names."""
    found = []
    for md in DOCS:
        for m in BENCH_PATH.finditer(md.read_text()):
            if m.group(1).endswith(".md") and m.group(1) != "README.md":
                found.append((rel(md), (BENCH / m.group(1)).resolve(), m.group(2) or ""))
    return found


def test_the_docs_cite_figures_from_bench() -> None:
    """The check below has something to check: the docs do cite bench/ (and sections of it)."""
    cited = citations()
    assert len({c[1] for c in cited}) >= 5 and any(c[2] for c in cited), cited


def test_every_figure_the_docs_cite_has_a_row() -> None:
    rows = indexed()
    files = {path for path, _ in rows}
    missing = sorted(
        f"{doc} cites bench/{path.relative_to(BENCH.resolve())}{'#' + anchor if anchor else ''}"
        for doc, path, anchor in citations()
        if (anchor and (path, anchor) not in rows) or (not anchor and path not in files)
    )
    assert not missing, "no row in bench/README.md for: " + "; ".join(missing)


def test_every_row_is_whole() -> None:
    rows = figure_rows()
    assert len(rows) >= 20, f"the Figures table of {rel(INDEX)} reads as {len(rows)} rows"
    bad = []
    for row in rows:
        if len(row) != 6:
            bad.append(f"{len(row)} cells, not 6: {row[0][:60]}")
            continue
        figure, command, date, commits, machine, results = row
        if not re.search(r"bench/\w|make \w|flywheel \w|git show", command):
            bad.append(f"no command: {figure[:60]}")
        if not DATE.match(date):
            bad.append(f"no date: {figure[:60]}")
        if not COMMIT.search(commits):
            bad.append(f"no commit: {figure[:60]}")
        if not machine or not LINK.search(results):
            bad.append(f"no machine or results link: {figure[:60]}")
    assert not bad, "; ".join(bad)


def test_every_link_of_the_index_resolves() -> None:
    broken = []
    for m in LINK.finditer(INDEX.read_text()):
        if re.match(r"[a-z]+:", m.group(1)):
            continue
        dest, anchor = target(m.group(1), BENCH)
        if not dest.exists():
            broken.append(f"{m.group(1)}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{m.group(1)}: no heading #{anchor} in {rel(dest)}")
    assert not broken, "; ".join(broken)


def test_every_script_the_index_names_exists() -> None:
    text = INDEX.read_text()
    named = {m.group(1) for m in BENCH_PATH.finditer(text)}
    named |= {
        m.group(1).partition("#")[0]
        for m in LINK.finditer(section(INDEX, "Scripts"))
        if not m.group(1).startswith("..")
    }
    assert {"wire.py", "e2e.py", "prefix_sharing.py"} <= named, named
    missing = sorted(n for n in named if not (BENCH / n).exists())
    assert not missing, f"{rel(INDEX)} names scripts that are not in bench/: {missing}"


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)


def test_every_commit_of_the_index_is_in_the_history() -> None:
    """A row's commit is where its figure can be read as recorded; a removed probe's is
    where its script can be recovered."""
    if git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("not a git checkout with its whole history (the commits cannot be looked up)")
    text = INDEX.read_text()
    commits = {c for row in figure_rows() if len(row) == 6 for c in COMMIT.findall(row[3])}
    commits |= {
        c
        for row in table_rows(section(INDEX, "Probes removed, figures kept"))
        for c in COMMIT.findall(row[2])
    }
    unknown = sorted(c for c in commits if git("cat-file", "-e", f"{c}^{{commit}}").returncode)
    assert not unknown, f"{rel(INDEX)} names commits this history lacks: {unknown}"
    recoverable = RECOVERABLE.findall(text)
    assert len(recoverable) >= 4, recoverable
    lost = sorted(
        f"{c}:{p}" for c, p in recoverable if git("cat-file", "-e", f"{c}:{p}").returncode
    )
    assert not lost, f"git show cannot recover: {lost}"


def mentioning_files() -> list[Path]:
    """Where a path into bench/ is a reference that must hold (the results files are
    records of their day and keep the names of then)."""
    files = [*DOCS, INDEX, REPO / "Makefile", REPO / "pyproject.toml", *(REPO / ".ci").glob("*")]
    for top in ("services", "tests", "proto", "bench", "configs", "deploy"):
        files += [f for ext in ("py", "md", "toml") for f in (REPO / top).rglob(f"*.{ext}")]
    records = {*BENCH.glob("results_*.md")}
    this = Path(__file__).resolve()  # its docstring's examples are not references
    return [f for f in files if f.is_file() and f not in records and f.resolve() != this]


def test_every_bench_file_mentioned_exists() -> None:
    missing = []
    for f in mentioning_files():
        for m in BENCH_PATH.finditer(f.read_text(errors="replace")):
            name = m.group(1)
            if re.search(r"\.(py|md|toml|png)$", name) and not (BENCH / name).exists():
                missing.append(f"{rel(f)}: bench/{name}")
    assert not missing, "; ".join(sorted(set(missing)))
