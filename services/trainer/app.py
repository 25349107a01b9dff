"""Wiring of the trainer service: the trainer restored from its checkpoint, rank 0's body.

Every rank loads the model and resumes from the newest checkpoint; rank 0
runs the RL loop under the service runtime (NATS, health, metrics) and,
when it ends, tells the other ranks to stop (cli.py: who runs what).
"""

from __future__ import annotations

import contextlib
import logging

from services.runtime.lifecycle import Body, ServiceContext
from services.trainer.distributed import DistInfo
from services.trainer.loop import RLLoop
from services.trainer.settings import TrainerSettings
from services.trainer.state import latest_checkpoint, load_checkpoint
from services.trainer.step import stop_followers
from services.trainer.trainer import Trainer

log = logging.getLogger(__name__)


def load_trainer(s: TrainerSettings, info: DistInfo) -> tuple[Trainer, int]:
    """The trainer, restored from the newest checkpoint if any, and its stream position."""
    trainer = Trainer.from_pretrained(s.model, s.train_config(), info)
    if info.is_main and (note := trainer.auto_lr_note("trainer.optim")):
        log.info("trainer: %s", note)
    seq = 0
    ckpt = latest_checkpoint(s.checkpoint_dir)
    if ckpt is not None:
        pos = load_checkpoint(trainer, ckpt)
        seq = int(pos.get("seq", 0))
        log.info("trainer: resumed from %s (step %d, stream seq %d)", ckpt, trainer.step, seq)
    return trainer, seq


def body(trainer: Trainer, seq: int) -> Body:
    """Rank 0's service body: the RL loop from stream position `seq`."""

    async def run(ctx: ServiceContext) -> None:
        settings = ctx.settings
        assert isinstance(settings, TrainerSettings)
        try:
            await RLLoop(ctx, settings, trainer, seq).run()
        finally:
            with contextlib.suppress(RuntimeError):  # followers may already be gone
                stop_followers(trainer.info)

    return run
