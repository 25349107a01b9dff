"""Tasks: what the user brings — data, prompt formatting, rewards, held-out evaluation.

The tasks domain, shared by the services (no service imports another), and
light to import: heavy packages (torch, transformers, datasets,
reasoning-gym, math-verify) are imported inside the functions that use them.

- `spec`:     the typed `[task]` / `[tasks.<name>]` tables of the run file;
- `registry`: what a source and a reward part are, and their registries:
              each is one class, registered where it is defined;
- `sources`:  rows of JSONL files, local HF datasets and user functions;
- `arithmetic`, `reasoning_gym`, `verifiers_env`: a task with its source
              (and, for the last two, its own reward);
- `verifiers_v1`, `verifiers_v1_harness`: verifiers v1 envs, whose episodes
              the rollout worker runs through the engine's /v1 chat route;
- `settings`: the task tables in every service's settings;
- `taskset`:  the run's tasks by name, their held-out split, the training
              order, their start-up checks;
- `prompts`:  row -> prompt text/messages -> token ids (training and eval alike);
- `rewards`:  the named reward functions and their weighted sum;
- `scoring`:  a task's reward for one completion, through the pool;
- `evaluate`: greedy pass@1 and sampled pass@k on the held-out split;
- `episode_spec`, `episode`, `tools`: multi-turn episodes with tools
              (`[task.episode]`), the turn loop, the tools.

Rewards and tools run in the sandbox (services/sandbox: `VerifierPool`,
`ToolPool`), below this package and imported through its face only.
"""
