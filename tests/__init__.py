"""Flywheel's tests: a package (`tests.harness`, `tests.unit.tasks.fixtures`, …) imported
from the repository root, which pytest puts on sys.path (`pythonpath` in pyproject.toml)."""
