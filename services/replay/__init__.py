"""`flywheel replay`: a recorded run's streams read back, with no engine running.

    flywheel replay train   -c run.toml [--set optim.lr=1e-5] [--out DIR]
    flywheel replay rescore -c run.toml [--reward '"math"'] [--out report.jsonl]
    flywheel replay export  -c run.toml --parquet samples.parquet [--dataset DIR]

A run's SAMPLES and BATCHES streams keep history (proto/streams.py); this
package reads them back (services/runtime/recording.py: by sequence, a
trimmed stream named at its first missing sequence). `train` runs the
trainer service itself (`[trainer] replay`: services/trainer/replay.py)
on the recorded batches and compares each version with the run's;
`rescore` scores the recorded completions with another reward; `export`
writes the samples as a table. docs/replay.md is the user's guide.
"""
