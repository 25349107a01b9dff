"""`flywheel up`'s preflight and plan for a distillation run (distill-real.toml)."""

from pathlib import Path

import pytest

from services.runtime.settings import load_settings
from services.stack.cli import preflight
from services.stack.plan import plan
from services.stack.settings import StackSettings

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "configs" / "examples" / "distill-real.toml"


def check(tmp_path: Path, text: str) -> int:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return preflight(load_settings(StackSettings, path), str(path), data=False)


def test_the_example_agrees_and_plans_a_teacher_engine(tmp_path: Path, capsys) -> None:
    assert check(tmp_path, EXAMPLE.read_text()) == 0, capsys.readouterr().err
    s = load_settings(StackSettings, EXAMPLE)
    specs = plan(s, EXAMPLE, "nats://x:1", iter(range(30000, 30100)).__next__)
    teacher = next(p for p in specs if p.kind == "teacher")
    assert "runs/demo-real/checkpoints/best" in teacher.argv


def test_distill_without_a_teacher_is_refused(tmp_path: Path, capsys) -> None:
    text = EXAMPLE.read_text()
    start = text.index("[teacher]")
    no_teacher = text[:start] + text[text.index("[task]") :]
    assert check(tmp_path, no_teacher) != 0
    assert "[trainer.distill] needs a [teacher] table" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("table", "why"),
    [
        ("[teacher]\nengines = 1\n", "needs [teacher] model"),
        ("[teacher]\nurls = []\nengines = 0\n", "a teacher needs a model"),
        ('[teacher]\nmodel = "m"\nattempts = 0\n', "attempts"),
        ('[teacher]\nmodel = "m"\ntimeout_s = 0\n', "timeout_s"),
    ],
)
def test_bad_teacher_tables_name_the_key(tmp_path: Path, table: str, why: str) -> None:
    from services.runtime.errors import ConfigError

    path = tmp_path / "run.toml"
    path.write_text('run = "x"\n' + table)
    with pytest.raises(ConfigError, match=why):
        load_settings(StackSettings, path)
