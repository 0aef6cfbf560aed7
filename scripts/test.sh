#!/usr/bin/env bash
# Set up and run the whole test suite (what CI runs). Installs redis-server and promtool (Debian
# package prometheus, for tests/deploy) if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ]; then
  # --no-install-recommends: prometheus brings promtool; its recommended exporters are not needed.
  (apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    >/dev/null) || echo "warning: could not install ${missing[*]}" >&2
fi
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
