"""Tasks: what the user brings — data, prompt formatting, rewards, held-out evaluation.

Shared by buffer, rollout and trainer (no service imports another), and
light to import: heavy packages (torch, transformers, datasets,
reasoning-gym, math-verify) are imported inside the functions that use them.

- `spec`:     the typed `[task]` / `[tasks.<name>]` tables of the run file;
- `sources`:  rows of JSONL files, local HF datasets, reasoning-gym, user
              functions and the arithmetic task; start-up checks;
- `taskset`:  the run's tasks by name, their held-out split, the training order;
- `prompts`:  row -> prompt text/messages -> token ids (training and eval alike);
- `rewards`:  the named reward functions and their weighted sum;
- `sandbox`:  `VerifierPool`, where every reward runs with a time limit;
- `scoring`:  a task's reward for one completion, through the pool;
- `evaluate`: greedy pass@1 and sampled pass@k on the held-out split;
- `episode_spec`, `episode`, `tools`: multi-turn episodes with tools
              (`[task.episode]`), the turn loop, the tools (`ToolPool` runs them).
"""
