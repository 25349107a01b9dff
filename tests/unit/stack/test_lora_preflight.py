"""`flywheel up`'s preflight refuses a LoRA run whose services would not agree."""

from pathlib import Path

from services.runtime.settings import load_settings
from services.stack.cli import preflight
from services.stack.settings import StackSettings

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "configs" / "examples" / "lora.toml"


def check(tmp_path: Path, text: str) -> int:
    path = tmp_path / "run.toml"
    path.write_text(text)
    s = load_settings(StackSettings, path)
    return preflight(s, str(path), data=False)


def test_the_example_agrees(tmp_path, capsys):
    assert check(tmp_path, EXAMPLE.read_text()) == 0, capsys.readouterr().err


def test_engines_without_adapters_or_workers_that_do_not_name_them_are_refused(tmp_path, capsys):
    text = EXAMPLE.read_text()
    assert check(tmp_path, text.replace("enable_lora = true", "enable_lora = false")) != 0
    assert "needs [engine] enable_lora = true" in capsys.readouterr().err
    assert check(tmp_path, text.replace("max_lora_rank = 16", "max_lora_rank = 4")) != 0
    assert "cannot serve [trainer.lora] rank 8" in capsys.readouterr().err
    assert check(tmp_path, text.replace("heads = []", 'heads = ["lm_head"]')) != 0
    assert "'lm_head'" in capsys.readouterr().err
    assert check(tmp_path, text.replace("\nlora = true", "\nlora = false")) != 0
    err = capsys.readouterr().err
    assert "needs [rollout] lora = true" in err and "[engine]" not in err
    # merged: engines take whole weights, nothing to agree on
    merged = text.replace('lora_mode = "adapter"', 'lora_mode = "merged"')
    assert check(tmp_path, merged.replace("enable_lora = true", "enable_lora = false")) == 0
