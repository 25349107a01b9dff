"""Flywheel's services: one package per process, the domains they share (tasks,
weights, engine_api, models) and the runtime under them (docs/ARCHITECTURE.md).
No service imports another."""
