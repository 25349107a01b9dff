"""`[replay]` of the run file: where replays write and how rescoring runs rewards.

The rest a replay needs is the recorded run's own settings, read from the
same run file: `run`, `[nats]`, `[task]`/`[tasks.*]` (rescoring's rewards),
`[stack] run_dir` and `model` (where `flywheel up` kept the run).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from services.runtime.settings import RunPath
from services.tasks.settings import TaskServiceSettings


class ReplaySettings(TaskServiceSettings):
    """`[replay]`; env overrides FLYWHEEL_REPLAY_<FIELD>."""

    section: ClassVar[str] = "replay"
    needs_task: ClassVar[bool] = True

    out_dir: RunPath | None = Field(
        None,
        description="Where `replay train` writes its weights, checkpoints and metrics "
        "(<out_dir>/weights/<run>/v000001/, …); None: <[stack] run_dir>/replay.",
    )
    verifier_timeout_s: float = Field(
        5.0, gt=0, description="`replay rescore`: time limit of one reward call (as rollout's)."
    )
    verifier_workers: int = Field(
        2, ge=1, description="`replay rescore`: sandboxed reward processes working at once."
    )
