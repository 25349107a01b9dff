"""The trainer's own randomness: one generator, part of the trainer's state.

Why not torch's default generator: it belongs to the whole process, and the
process does more than train. The held-out evaluation loads and generates on
a thread beside the steps (evaluating.py); anything on any thread that
reseeds or draws from the default generator moves the steps' draws at a
moment that depends on timing, and such a run cannot be replayed bit for
bit (`flywheel replay train`, docs/replay.md). So the trainer owns a CPU
`torch.Generator`, seeded from `[trainer.runtime] seed`:

- every random draw of a step takes it explicitly (Clip-Cov's choice of
  tokens, core/loss.py); a CPU generator gives the same draw on any device;
- checkpoints keep its state beside the process's (stateformat.py), so a
  resumed trainer, and a replay, go on with the same stream.

Dropout (a model's own, PEFT's `lora_dropout`) takes no generator: its masks
come from the default generator. `seed_default` reseeds that from the
trainer's generator at the start of each step, so the masks too follow the
trainer's state, whatever touched the default generator before. Nothing in
the trainer process draws from it during a step (the evaluation samples
through a generator of its own, services/tasks/evaluate.py); a model without
dropout never reads it at all.
"""

from __future__ import annotations

import torch

# torch.manual_seed takes any non-negative int64.
_SEED_BOUND = 2**63 - 1


def trainer_generator(seed: int) -> torch.Generator:
    """The trainer's generator, seeded from the run's seed (a CPU one: see the docstring)."""
    return torch.Generator(device="cpu").manual_seed(seed)


def seed_default(generator: torch.Generator) -> None:
    """Reseed torch's default generators (CPU and, where present, CUDA) from `generator`:
    one draw of it, so a step's dropout masks are a function of the trainer's state."""
    torch.manual_seed(int(torch.randint(0, _SEED_BOUND, (), generator=generator)))
