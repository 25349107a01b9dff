"""The trainer: the RL loop (`loop`: step → publish → record) and SFT (`sft/`).

`core/` (pure: advantages, logprobs, losses, micro-batches), `batches`,
`step`, `publishing`, `metrics`, `state` (checkpoints), `trainer` (the
model and optimizer), `settings` (every `[trainer]` and `[sft]` setting),
`app` (wiring), `cli`.
"""
