"""Find a run that `flywheel up` is running on this machine, from its run file.

`flywheel up` starts an embedded nats-server on a free port and records it
in `<run_dir>/run.json` (with its own pid) while it runs. A command that acts
on that run — `flywheel status -c run.toml`, a rollout worker added by hand
(`flywheel rollout -c run.toml`) — reads the run file's `[stack] run_dir`,
finds the record, and connects there; with no run up it fails in one line
instead of retrying 127.0.0.1:4222 for a minute.

This applies only when the run file leaves NATS to `flywheel up`: no
`[nats] url`, no `FLYWHEEL_<SECTION>_NATS__URL`, and `[stack] embedded_nats`
not false. Otherwise the URL given is used as it is (Kubernetes, an
external server).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.runtime.errors import ConfigError
from services.runtime.settings import read_run_file, run_path

RECORD = "run.json"
DEFAULT_RUN_DIR = "runs/demo"  # StackSettings.run_dir's default


@dataclass(frozen=True)
class LocalRun:
    nats_url: str
    pid: int
    run_dir: Path
    model: str | None


def record(run_dir: Path, nats_url: str, model: Path | None) -> Path:
    """Written by `flywheel up` once its NATS is up (removed when it stops)."""
    path = run_dir / RECORD
    tmp = path.with_name(f".{RECORD}.tmp")
    tmp.write_text(
        json.dumps(
            {"nats_url": nats_url, "pid": os.getpid(), "model": str(model) if model else None}
        )
    )
    tmp.replace(path)
    return path


def forget(run_dir: Path) -> None:
    (run_dir / RECORD).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find(run_dir: Path) -> LocalRun | None:
    """The run `flywheel up` runs from `run_dir`, or None (no record, or its process is gone)."""
    try:
        doc = json.loads((run_dir / RECORD).read_text())
        run = LocalRun(str(doc["nats_url"]), int(doc["pid"]), run_dir, doc.get("model"))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return run if _alive(run.pid) else None


def leaves_nats_to_up(doc: dict[str, Any], section: str) -> bool:
    nats = doc.get("nats", {})
    stack = doc.get("stack", {})
    explicit = (isinstance(nats, dict) and "url" in nats) or any(
        os.environ.get(f"{p}NATS__URL") for p in ("FLYWHEEL_", f"FLYWHEEL_{section.upper()}_")
    )
    return not explicit and not (isinstance(stack, dict) and stack.get("embedded_nats") is False)


def attach(config: str | Path, section: str) -> dict[str, Any]:
    """Overrides that point `section`'s settings at the local run of `config` ({} if the run
    file names its own NATS); ConfigError in one line when no run is up."""
    doc = read_run_file(config)
    if not leaves_nats_to_up(doc, section):
        return {}
    stack = doc.get("stack", {}) if isinstance(doc.get("stack"), dict) else {}
    run_dir = run_path(stack.get("run_dir", DEFAULT_RUN_DIR))
    run = find(run_dir)
    if run is None:
        raise ConfigError(
            f"no run is up for {config}: {run_dir / RECORD} names no live `flywheel up` "
            f"(start one with `flywheel up -c {config}`, or set [nats] url)"
        )
    out: dict[str, Any] = {"nats": {**doc.get("nats", {}), "url": run.nats_url}}
    section_table = doc.get(section, {}) if isinstance(doc.get(section), dict) else {}
    if (
        section == "rollout"
        and "model" not in section_table
        and run.model
        and not os.environ.get("FLYWHEEL_ROLLOUT_MODEL")
    ):
        out["model"] = run.model  # the tokenizer of the run's model, as `up` gives its workers
    return out
