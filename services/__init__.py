"""Flywheel's services: one package per process (docs/ARCHITECTURE.md), and `common/`,
what they share. No service imports another."""
