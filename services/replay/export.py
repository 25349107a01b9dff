"""`flywheel replay export`: a recorded run's samples as Parquet and/or a `datasets` directory.

Every sample every rollout worker published (the SAMPLES stream: trained
or not; `trained_step` says which batch trained it, None for a group the
buffer left out), one row each (samples.py). pyarrow and `datasets` come
with the `datasets` extra (`pip install 'flywheel[datasets]'`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.runtime.errors import ConfigError


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError as e:
        raise ConfigError("replay export needs pyarrow: pip install 'flywheel[datasets]'") from e
    return pyarrow


def table(rows: list[dict[str, Any]]) -> Any:
    """The rows as a pyarrow Table with token ids as int32 and logprobs as float32 lists."""
    pa = _pyarrow()
    schema = pa.schema(
        [
            ("run", pa.string()),
            ("stream_seq", pa.int64()),
            ("group_id", pa.string()),
            ("sample_id", pa.string()),
            ("task_id", pa.string()),
            ("task_name", pa.string()),
            ("index", pa.int32()),
            ("prompt", pa.string()),
            ("completion", pa.string()),
            ("prompt_ids", pa.list_(pa.int32())),
            ("response_ids", pa.list_(pa.int32())),
            ("logprobs", pa.list_(pa.float32())),
            ("loss_mask", pa.list_(pa.uint8())),
            ("env_tokens", pa.int32()),
            ("reward", pa.float64()),
            ("reward_parts", pa.string()),
            ("verifier_error", pa.string()),
            ("finish_reason", pa.string()),
            ("weight_version", pa.int64()),
            ("weight_version_last", pa.int64()),
            ("engine_id", pa.string()),
            ("trained_step", pa.int64()),
        ]
    )
    return pa.Table.from_pylist(rows, schema=schema)


def write(rows: list[dict[str, Any]], parquet: Path | None, dataset: Path | None) -> list[str]:
    """Write the rows where asked; what was written, one line each."""
    t = table(rows)
    done = []
    if parquet is not None:
        import pyarrow.parquet as pq

        parquet.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(t, parquet)
        done.append(f"{parquet} ({t.num_rows} rows, Parquet)")
    if dataset is not None:
        try:
            from datasets import Dataset, disable_progress_bars
        except ImportError as e:
            raise ConfigError("--dataset needs `datasets`: pip install 'flywheel[datasets]'") from e
        disable_progress_bars()  # one line per file written is enough
        Dataset(t).save_to_disk(str(dataset))
        done.append(f"{dataset} ({t.num_rows} rows, datasets.load_from_disk)")
    return done
