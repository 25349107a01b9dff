"""Flywheel's CPU engine: a faithful subset of SGLang 0.5.x's HTTP API on transformers.

On a GPU the rollout tier talks to a real SGLang server; on a CPU it talks to
this one, through the same client (`services.common.engine_client`). Layers:

- `protocol`  pure request parsing/validation and response shaping (SGLang's
  `GenerateReqInput` fields in, `meta_info` out);
- `sampling`  pure per-row sampling and logprob maths on logits tensors;
- `kvbatch`   pure tensor operations on a left-padded batched KV cache
  (join, drop rows, trim);
- `scheduler` the continuous-batching loop that owns the model, run in one
  dedicated thread;
- `server`    the aiohttp adapter; `__main__` the command line.
"""
