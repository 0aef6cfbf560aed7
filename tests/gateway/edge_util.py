"""Helpers for the edge tests (auth, allowlist, quotas, metrics): keys, key files, gateways."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai

from gateway.app import build_state, create_app
from gateway.config import GatewaySettings
from gateway.deps import GatewayState
from tests.gateway.conftest import MAX_MODEL_LEN, SERVED_NAME, serve

KEY_ALPHA = "sk-tandem-alpha-3f9c1d2e8b7a6054"
KEY_ALPHA_2 = "sk-tandem-alpha2-77e0a1b2c3d4e5f6"
KEY_BETA = "sk-tandem-beta-c0ffee00deadbeef11"
KEY_GAMMA = "sk-tandem-gamma-0a1b2c3d4e5f6071"
MESSAGES = [{"role": "user", "content": "Hi"}]


def hash_prefix(key: str, num_chars: int = 8) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:num_chars]


def write_keys(path: Path, entries: list[tuple[str, str, dict | None]]) -> Path:
    """A key file: `key:tenant[:limits-json]` lines, with a comment to be skipped."""
    lines = ["# tandem keys (test)"]
    for key, tenant, limits in entries:
        lines.append(f"{key}:{tenant}" + (f":{json.dumps(limits)}" if limits else ""))
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def edge_gateway(model_path, model_info, **overrides) -> Iterator[tuple[str, GatewayState]]:
    """A gateway in this process (uvicorn thread); yields its URL and state."""
    settings = GatewaySettings(
        model=str(model_path),
        served_model_name=[SERVED_NAME],
        max_model_len=MAX_MODEL_LEN,
        **overrides,
    )
    state = build_state(settings, model=model_info)
    with serve(create_app(settings, state)) as url:
        yield url, state


def sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def chat(url: str, key: str, **kwargs):
    kwargs.setdefault("max_tokens", 2)
    return sdk(url, key).chat.completions.create(model=SERVED_NAME, messages=MESSAGES, **kwargs)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll until `predicate()` holds; fail after `timeout_s` (a condition awaited, never a
    fixed sleep: e.g. access-log lines and metrics, written in batches up to 0.1 s after a
    request, gateway/bookkeeping.py)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
