"""Run under torchrun by test_fsdp.py: jobs of one train step with FSDP2, each saving weights.

`python -m torch.distributed.run … -m tests.integration.trainer.fsdp_worker` from the
repository root (a module of the tests package: no sys.path edits).

argv: MODEL_DIR JOBS_JSON, a file listing jobs `{"out": DIR, "cfg": CONFIG_JSON,
"resume": DIR or null}`, run in turn in the one process group (torchrun and three
processes importing torch, once for all). With `resume`, every rank first resumes from
its latest checkpoint there. Each job writes OUT/metrics.json (rank 0, with the step
reached), OUT/weights (HF dir gathered on rank 0) and OUT/ckpt (DCP, all ranks).
"""

import json
import sys
from pathlib import Path

from services.trainer.distributed import DistInfo, init_distributed, shutdown
from services.trainer.settings import TrainConfig
from services.trainer.state import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.trainer import Trainer
from tests.integration.trainer.trainer_helpers import random_batch


def run_job(model_dir: str, job: dict, info: DistInfo) -> None:
    out = Path(job["out"])
    trainer = Trainer.from_pretrained(model_dir, TrainConfig.model_validate_json(job["cfg"]), info)
    if job.get("resume"):
        load_checkpoint(trainer, latest_checkpoint(job["resume"]))
    metrics = trainer.train_step(random_batch(seed=1))
    trainer.save_weights(out / "weights")
    save_checkpoint(trainer, out / "ckpt", {"seq": 7})
    if info.is_main:
        (out / "metrics.json").write_text(json.dumps(metrics))


def main() -> None:
    model_dir, jobs = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    info = init_distributed()
    for job in jobs:
        run_job(model_dir, job, info)
    shutdown(info)


if __name__ == "__main__":
    main()
