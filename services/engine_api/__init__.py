"""The engine API: how Flywheel talks to an engine (SGLang, or the CPU engine).

- `engine_client`   the one HTTP client (rollout workers, sync, benches);
- `sglang_api`      what each SGLang release does (routes, errors, rules);
- `sglang_launcher` the command line that starts a real SGLang server.
"""
