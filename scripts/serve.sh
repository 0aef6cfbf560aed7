#!/usr/bin/env bash
# Set up, then run `tandem serve` (SmolLM2-135M-Instruct by default: works offline).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/tandem serve "$@"
