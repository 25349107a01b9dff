"""Flywheel's Tinker-compatible training API: loops written against the Tinker SDK run on
your own machine by changing the client's `base_url` (docs/tinker.md).

Its own process (`flywheel tinker`, `python -m services.tinker`); it imports the
runtime and the models domain, no other service. Layers:

- `core`      the pure part: requests checked against the losses and the
  `[tinker]` limits (typed errors naming what is wrong), the request log keyed by
  (owner, seq_id) that answers a retry once and never runs it twice, sessions;
- `losses`    the built-in losses per token (cross_entropy, importance_sampling,
  ppo, cispo, dro, gspo) and their loss_fn_config;
- `model`     one base model with a PEFT LoRA adapter and an AdamW per training
  client, and the in-process sampler (used when `[tinker] engines` is empty);
- `engines`   sampling on the engines: a sampler's adapter as a PEFT directory loaded
  on each by name, the SDK's sample as SGLang's /generate and its answer back;
- `batching`  sample requests that differ only in their count, generated as one batch
  (tinker-cookbook's RL loop sends a group's replies one request each);
- `state`     saved training states on disk (`[tinker] state_dir`): adapter,
  AdamW state and step count under a tinker:// path, written whole or not at all;
- `journal`   the durable request log (`[tinker] journal_stream`): every accepted
  request and its answer on a JetStream stream, and the plan a start replays (from
  the newest whole replay checkpoint); `checkpoint` writes and reads those
  (`[tinker] checkpoint_dir`); `rebuild` loads one and replays the rest through the
  routes' own handlers before the server listens;
- `wire`      the SDK's protobuf messages (forward_backward in, outputs and
  samples out), through the SDK's own generated module;
- `app`       the aiohttp adapter: the SDK's `/api/v1` routes and its futures;
  `state_routes` save_state / load_state / create_training_client_from_state and
  the checkpoint listing; `routing` what both share (body, future, retries);
  `cli` the command line, `settings` its `[tinker]` table.
"""
