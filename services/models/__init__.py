"""Models: building and finding the model directories a run starts from.

- `tiny_model`  a tiny Qwen2 with a character tokenizer (the demo, the tests).
"""
