"""The CPU engine's pure core: SGLang's request and response shapes, sampling maths,
batched-KV tensor operations, and one sequence's stop rules. No HTTP, no threads.
"""
