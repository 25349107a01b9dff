#!/usr/bin/env bash
# Write deploy/k8s/base/nats-credentials.env: a random NATS password per
# service (the keys of the `flywheel-nats` Secret; nats-auth.conf names the
# users). There is no default password: the base does not build without this
# file. An existing file is kept (the passwords of a running cluster); --force
# replaces it. For a shared cluster, prefer a Secret from your secret store
# (e.g. an ExternalSecret named flywheel-nats with the same keys).
set -euo pipefail
out="$(dirname "$0")/base/nats-credentials.env"
if [[ -e "$out" && "${1:-}" != "--force" ]]; then
  echo "keeping $out (--force to replace it)"
  exit 0
fi
tmp="$(mktemp "$out.XXXXXX")"
chmod 600 "$tmp"
for service in buffer rollout trainer sync; do
  echo "$service-password=$(head -c 32 /dev/urandom | base64 | tr -d '/+=\n' | head -c 40)" >>"$tmp"
done
mv -f "$tmp" "$out"
echo "wrote $out"
