"""The trainer's pure core: advantages, logprobs, losses and batch planning.

Everything here is a function of tensors (torch only): no disk, no network,
no torch.distributed. The adapters around it (model loading, FSDP, the
optimizer step, checkpoints) live one level up in `services.trainer`.
"""
