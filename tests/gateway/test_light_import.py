"""The gateway process imports no torch (ARCHITECTURE: the house, floor by floor).

A gateway replica should start in seconds and idle small; importing torch and the model runner
cost ~9 s and hundreds of MB. Checked in a fresh interpreter: this test process has long since
imported torch through its fixtures.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

HEAVY_ROOTS = ("torch", "triton")
HEAVY_MODULES = ("engine.model_runner", "engine.engine_core")


def _heavy_modules_after(code: str) -> list[str]:
    probe = (
        f"{code}\nimport sys\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY_ROOTS!r} "
        f"or m in {HEAVY_MODULES!r}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])


def test_import_gateway_app_loads_no_torch():
    assert _heavy_modules_after("import gateway.app") == []


def test_gateway_main_and_routing_load_no_torch():
    # `python -m gateway` imports __main__ before it parses arguments and builds the app;
    # routing imports the Redis registry and index, the KV router and the watch feed on demand.
    code = (
        "import gateway.__main__, gateway.kv_router, gateway.kv_watch, gateway.redis_index, "
        "gateway.redis_registry"
    )
    assert _heavy_modules_after(code) == []


def test_smollm2_folder_resolves_without_torch():
    # `--model HuggingFaceTB/SmolLM2-135M-Instruct`: the cached build is found without torch
    # (torch is only imported to build it).
    assert _heavy_modules_after("import engine.weights.smollm2, engine.weights.hub") == []


def test_create_app_loads_no_torch(tiny_qwen3_path):
    # transformers 5 imports torch from its config classes whenever torch is installed: the
    # gateway reads config.json as JSON and loads its tokenizer with engine.light_tokenizer.
    code = (
        "from gateway.app import create_app\n"
        "from gateway.config import GatewaySettings\n"
        f"create_app(GatewaySettings(model={str(tiny_qwen3_path)!r}, "
        "served_model_name=['tiny'], max_model_len=256, decode='127.0.0.1:1'))"
    )
    assert _heavy_modules_after(code) == []


def test_create_app_loads_no_transformers(tiny_qwen3_path):
    code = (
        "from gateway.app import create_app\n"
        "from gateway.config import GatewaySettings\n"
        f"create_app(GatewaySettings(model={str(tiny_qwen3_path)!r}, "
        "served_model_name=['tiny'], max_model_len=256, decode='127.0.0.1:1'))\n"
        "import sys\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'transformers']"
    )
    assert _heavy_modules_after(code) == []
