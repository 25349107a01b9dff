#!/usr/bin/env bash
# The secrets the manifests need and git does not hold (no defaults: the
# base does not build without them):
#  - base/nats-credentials.env: a random NATS password per service (the keys
#    of the `flywheel-nats` Secret; nats-auth.conf names the users);
#  - components/nats-cluster/tls/: a CA and the NATS servers' certificate
#    (the `nats-tls` Secret: clients verify the servers, the servers each
#    other on their routes), with openssl.
# What exists is kept (the secrets of a running cluster); --force replaces
# it. For a shared cluster, prefer your secret store (e.g. ExternalSecrets
# named flywheel-nats / nats-tls with the same keys) and cert-manager.
set -euo pipefail
k8s="$(cd "$(dirname "$0")" && pwd)"
force="${1:-}"

out="$k8s/base/nats-credentials.env"
if [[ -e "$out" && "$force" != "--force" ]]; then
  echo "keeping $out (--force to replace it)"
else
  tmp="$(mktemp "$out.XXXXXX")"
  chmod 600 "$tmp"
  for service in buffer rollout trainer sync; do
    echo "$service-password=$(head -c 32 /dev/urandom | base64 | tr -d '/+=\n' | head -c 40)" >>"$tmp"
  done
  mv -f "$tmp" "$out"
  echo "wrote $out"
fi

tls="$k8s/components/nats-cluster/tls"
if [[ -e "$tls/tls.crt" && "$force" != "--force" ]]; then
  echo "keeping $tls (--force to replace it)"
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
ssl() { openssl "$@" 2>/dev/null; }
ssl req -x509 -newkey rsa:2048 -nodes -days 825 -subj "/CN=flywheel-nats-ca" \
  -keyout "$work/ca.key" -out "$work/ca.crt"
ssl req -newkey rsa:2048 -nodes -subj "/CN=nats" -keyout "$work/tls.key" -out "$work/tls.csr"
# Every name a client or a route dials: the service and each pod behind the
# headless service, short and in the namespace (NATS_NAMESPACE, default the
# overlays' `flywheel`); localhost for port-forwards.
ns="${NATS_NAMESPACE:-flywheel}"
san="DNS:nats,DNS:nats.$ns.svc,DNS:nats.$ns.svc.cluster.local,DNS:*.nats-headless"
san="$san,DNS:*.nats-headless.$ns.svc,DNS:*.nats-headless.$ns.svc.cluster.local"
san="$san,DNS:localhost,IP:127.0.0.1"
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$san" >"$work/ext"
ssl x509 -req -in "$work/tls.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" -CAcreateserial \
  -days 825 -out "$work/tls.crt" -extfile "$work/ext"
mkdir -p "$tls"
chmod 600 "$work/tls.key"
mv -f "$work/ca.crt" "$work/tls.crt" "$work/tls.key" "$tls/"
echo "wrote $tls (CA key discarded: --force makes a new CA and certificate)"
