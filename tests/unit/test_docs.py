"""The README and the guides in docs/ say only what exists.

- every relative link resolves to a file of the repository, and a `#anchor`
  to a heading of the markdown file it points at (GitHub's slugs);
- every `make <target>` they name is a Makefile target, and every
  `flywheel <command>` a command of the CLI (services/cli.py), with every
  `--flag` of `flywheel up` and `flywheel demo` one their parsers take;
- the README stays a quickstart (at most 150 lines), and its run file is one
  the services accept (its task validates, its reward imports).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

from tests.harness import REPO

DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = FENCE.sub("", md.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def links(md: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(md.read_text())]


@pytest.mark.parametrize("md", DOCS, ids=rel)
def test_every_relative_link_resolves(md: Path) -> None:
    broken = []
    for target in links(md):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists() or REPO.resolve() not in [dest, *dest.parents]:
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {rel(dest)}")
    assert not broken, f"{rel(md)}: " + "; ".join(broken)


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return {
        t for line in re.findall(r"^([A-Za-z0-9_.\- ]+):(?!=)", text, re.M) for t in line.split()
    }


def code(md: Path) -> str:
    """The code of a markdown file: its fenced blocks and `inline spans` (prose may say
    "make it" or "Flywheel is"; a command is written as code)."""
    text = md.read_text()
    blocks = FENCE.findall(text)
    spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    return "\n".join([*blocks, *spans])


def named(pattern: str) -> list[tuple[str, str]]:
    """(file, what) for every match of `pattern` in the code of the README and the guides."""
    return [(rel(md), m.group(1)) for md in DOCS for m in re.finditer(pattern, code(md))]


def test_every_make_target_named_exists() -> None:
    targets = make_targets()
    assert {"demo", "test", "demo-real", "test-fast"} <= targets
    missing = [(f, t) for f, t in named(r"\bmake[ \t]+([a-z][\w-]*)") if t not in targets]
    assert not missing, missing


def test_every_flywheel_command_named_exists() -> None:
    from services.cli import COMMANDS

    said = named(r"\bflywheel[ \t]+([a-z][\w-]*)")
    # "flywheel buffer|rollout|trainer|sync": each of the alternatives
    alternatives = named(r"\bflywheel[ \t]+((?:[a-z-]+\|)+[a-z-]+)")
    said += [(f, c) for f, cs in alternatives for c in cs.split("|")]
    missing = [(f, c) for f, c in said if c not in COMMANDS]
    assert not missing, missing


@pytest.mark.parametrize("command", ["up", "demo"])
def test_every_flag_named_for_up_and_demo_exists(command: str) -> None:
    from services.stack.cli import parser as up_parser
    from services.stack.demo import parser as demo_parser

    p = {"up": up_parser, "demo": demo_parser}[command]()
    flags = {s for a in p._actions for s in a.option_strings}
    said = named(rf"\bflywheel {command}\b([^\n]*)")
    missing = [
        (f, flag) for f, args in said for flag in re.findall(r"(?<!\S)(--?[a-z][\w-]*)", args)
        if flag not in flags
    ]  # fmt: skip
    assert not missing, missing


def test_the_readme_is_a_quickstart() -> None:
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 150, f"README.md has {lines} lines; the rest belongs in docs/"


def readme_run_file() -> str:
    blocks = re.findall(r"^```toml\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S)
    return next(b for b in blocks if "[task]" in b)


def test_the_readme_s_run_file_is_one_the_services_accept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its task validates and checks (data file, reward import) as `flywheel up` would,
    with the data and reward the README writes beside it."""
    from services.buffer.settings import BufferSettings
    from services.runtime.settings import load_settings

    readme = (REPO / "README.md").read_text()
    reward = re.search(r"cat > my_reward.py <<'EOF'\n(.*?)^EOF", readme, re.M | re.S)
    row = re.search(r"echo '(\{.*?\})' >> train.jsonl", readme)
    assert reward is not None and row is not None, "the README's data and reward"
    (tmp_path / "my_reward.py").write_text(reward.group(1))
    (tmp_path / "train.jsonl").write_text(row.group(1) + "\n")
    config = tmp_path / "my-task.toml"
    config.write_text(readme_run_file())
    tomllib.loads(config.read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # the README's `export PYTHONPATH=.`
    tasks = load_settings(BufferSettings, config).task_set()
    tasks.check(data=True)
    sys.modules.pop("my_reward", None)


def test_the_readme_s_demo_real_figure_is_the_seeds_the_bench_recorded() -> None:
    """The README's `make demo-real` figure is the median and range of the seeded runs of
    the committed run file that bench/demo_real_seeds.py wrote into the results (section 7's
    table), computed by the bench's own `headline`: a new series changes both or the test
    fails."""
    sys.path.insert(0, str(REPO))
    from bench.demo_real_seeds import headline, parse_table

    results = (REPO / "bench" / "results_demo_real.md").read_text()
    section = results.split("## 7.", 1)[1]
    runs = parse_table(section)
    assert len(runs) >= 8, "section 7 holds the 8 seeds' table"
    readme = (REPO / "README.md").read_text().replace("**", "")
    assert headline(runs) in " ".join(readme.split()), headline(runs)
