"""The buffer: the dataset, admission within the staleness bound, batch assembly.

`core` (pure: cursor, admission, assembler, tasks from rows), `state` (its
KV bucket), `app` (the message loops and the dispatcher), `metrics`,
`settings`, `cli`.
"""
