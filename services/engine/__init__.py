"""Flywheel's CPU engine: a faithful stand-in for SGLang 0.5.x's HTTP API, on transformers.

Its own process (`python -m services.engine`, `flywheel engine`), beside a
rollout worker; it imports only the runtime (services/runtime/) and the engine API
(services/engine_api/).

On a GPU the rollout tier talks to a real SGLang server; on a CPU it talks to
this one, through the same client (`services.engine_api.engine_client`). It
answers as one SGLang release (`[engine] sglang_version`): that release's
routes, errors and rules, never more kindly (tests/contract). Layers:

- `core/`, the pure parts: `protocol` request parsing/validation and
  response shaping (SGLang's `GenerateReqInput` fields in, `meta_info` out,
  per-token version spans); `sampling` per-row sampling and logprob maths
  on logits tensors; `kvbatch` tensor operations on a left-padded batched
  KV cache (join, drop rows, trim); `sequence` one sequence's scheduler
  state and stop rules;
- `batch`     the running rows: batched prefill, decode steps, sampling;
- `scheduler` the continuous-batching loop that owns the model, run in one
  dedicated thread: admission, pause modes, weight updates and flushes;
- `app`, `probes`, `info`, `state`  the aiohttp adapter (generate and
  admin; health, readiness and the API key; read-only endpoints; what the
  handlers share); `cli` the command line, `settings` its `[engine]` table;
- `sglang_launcher`  the command that starts a real SGLang server instead.
"""
