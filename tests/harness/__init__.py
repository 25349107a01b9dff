"""The test harness: what tests need to start, watch and read real parts.

- `ports.free_port`: the one free-port helper of the tests;
- `poll`: waiting with a deadline (`wait_for`, `eventually`), never a fixed sleep;
- `runfile.run_file`: a run file's TOML from keyword tables;
- `probe`: HTTP JSON, readiness and Prometheus samples of a running process;
- `streams`: a run's JetStream streams read as an operator would (a plain client);
- `stack.Stack`: a run's processes as `flywheel up` plans them
  (services/stack/plan.py), started and stopped by the product's own
  Supervisor (services/stack/supervisor.py), with the handles a test needs:
  start a planned process later, kill -9 one, restart it, read its metrics;
- `up.UpRun`: `flywheel up` itself as a subprocess (chaos, e2e, deploy);
- `engines`: the CPU engine as a subprocess or in this process;
- `prometheus`: a real Prometheus on loopback scraping given targets.

Subprocess helpers run as modules from the repository root
(`python -m tests.integration.trainer.fsdp_worker`), so nothing here or in
the tests edits `sys.path`.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root (cwd of every subprocess)
