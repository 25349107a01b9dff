"""Run under torchrun by test_fsdp.py: one train step with FSDP2, then save weights.

`python -m torch.distributed.run … -m tests.integration.trainer.fsdp_worker` from the
repository root (a module of the tests package: no sys.path edits).

argv: MODEL_DIR OUT_DIR CONFIG_JSON [RESUME_DIR]. With RESUME_DIR, every rank first
resumes from its latest checkpoint. Writes OUT_DIR/metrics.json (rank 0, with the
step reached), OUT_DIR/weights (HF dir gathered on rank 0) and OUT_DIR/ckpt (DCP,
all ranks).
"""

import json
import sys
from pathlib import Path

from services.trainer.distributed import init_distributed, shutdown
from services.trainer.settings import TrainConfig
from services.trainer.state import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.trainer import Trainer
from tests.integration.trainer.trainer_helpers import random_batch


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    cfg = TrainConfig.model_validate_json(sys.argv[3])
    info = init_distributed()
    trainer = Trainer.from_pretrained(model_dir, cfg, info)
    if len(sys.argv) > 4:
        load_checkpoint(trainer, latest_checkpoint(sys.argv[4]))
    metrics = trainer.train_step(random_batch(seed=1))
    trainer.save_weights(out / "weights")
    save_checkpoint(trainer, out / "ckpt", {"seq": 7})
    if info.is_main:
        (out / "metrics.json").write_text(json.dumps(metrics))
    shutdown(info)


if __name__ == "__main__":
    main()
