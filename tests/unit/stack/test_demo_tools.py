"""The tool demo's pieces: its run file survives the demo's TOML writer; its SFT traces."""

from __future__ import annotations

import tomllib

from services.runtime.settings import load_settings
from services.stack.demo import dump_toml
from services.stack.demo_tools import CONFIG, tool_records
from services.stack.settings import StackSettings


def test_the_tools_run_file_round_trips_through_the_demo_writer() -> None:
    doc = tomllib.loads(CONFIG.read_text())
    assert tomllib.loads(dump_toml(doc)) == doc  # lists of inline tables included
    spec = load_settings(StackSettings, CONFIG).task_set().specs["arithmetic"]
    assert spec.episode is not None and spec.episode.stop == ("</calc>", "</answer>")


def test_sft_traces_call_the_tool_part_of_the_time() -> None:
    recs = tool_records(2000, seed=7, tool_fraction=0.35)
    calls = [r for r in recs if isinstance(r["completion"], list)]
    assert 0.3 < len(calls) / len(recs) < 0.4
    r = calls[0]
    a, b = r["prompt"].rstrip("=").split("*")
    product = str(int(a) * int(b))
    assert len(a) == len(b) == 3
    assert r["completion"] == [
        {"text": f"<calc>{a}*{b}</calc>"},
        {"text": f"<result>{product}</result>", "train": True},  # the observation
        {"text": f"<answer>{product}</answer>"},
    ]
    direct = next(r for r in recs if not isinstance(r["completion"], list))
    a, b = direct["prompt"].rstrip("=").split("*")
    assert direct["completion"] == f"<answer>{int(a) * int(b)}</answer>"
