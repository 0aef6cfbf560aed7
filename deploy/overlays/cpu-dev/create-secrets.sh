#!/usr/bin/env bash
# Create Tandem's Secrets with fresh random values (a development cluster; for production
# see docs/operations.md, "Secrets"). Values go through files in a private temporary folder,
# never through argv or this tree. Prints the API key once: keep it.
# Usage: deploy/overlays/cpu-dev/create-secrets.sh [NAMESPACE]
set -euo pipefail
ns="${1:-tandem}"
umask 077
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
rand() { python3 -c 'import secrets; print(secrets.token_hex(32))'; }
rand > "$dir/token"
api_key="sk-$(rand)"
printf '%s:dev\n' "$api_key" > "$dir/api-keys"
password="$(rand)"
printf 'redis://:%s@tandem-redis:6379/0\n' "$password" > "$dir/url"
printf 'requirepass %s\n' "$password" > "$dir/redis-auth.conf"
kubectl get namespace "$ns" >/dev/null 2>&1 || kubectl create namespace "$ns"
kubectl -n "$ns" create secret generic tandem-internal-token --from-file=token="$dir/token"
kubectl -n "$ns" create secret generic tandem-api-keys --from-file=api-keys="$dir/api-keys"
kubectl -n "$ns" create secret generic tandem-redis \
  --from-file=url="$dir/url" --from-file=redis-auth.conf="$dir/redis-auth.conf"
echo "API key (also in Secret tandem-api-keys): $api_key"
