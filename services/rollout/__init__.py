"""A rollout worker: tasks in, scored sample groups out, for the one engine beside it.

`core` (pure: request ids, versions, samples), `worker` (one task, one
group; heartbeats), `weights_fetch` (the engine's local weight copies),
`episodes` (multi-turn episodes through the engine), `app` (wiring), `metrics`, `settings`,
`cli`.
"""
