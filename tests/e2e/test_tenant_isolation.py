"""Tenant isolation end to end: the gateway salts each tenant's prefix hashes, so the same long
prompt from another tenant gets no prefix-cache hit at any instance; from the same tenant it
does (measured by the services' own hit counters)."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.cluster import deploy

FLAGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "128"]
PROMPT = "The museum's long catalogue lists paintings, statues, coins and maps " * 3


@pytest.fixture(scope="module")
def dep(tiny_qwen3_path):
    mp = pytest.MonkeyPatch()
    mp.setenv("TANDEM_API_KEYS", "key-a-123:tenant-a,key-b-456:tenant-b")
    try:
        d = deploy(str(tiny_qwen3_path), 1, 1, FLAGS)
    finally:
        mp.undo()  # the gateway process has its copy; keep this process clean
    yield d
    d.stop()


def _hits(dep) -> int:
    return sum(ld.prefix_cache_hits for r in ("prefill", "decode") for ld in dep.loads(r))


def _ask(dep, key: str):
    client = openai.OpenAI(base_url=dep.base_url, api_key=key, max_retries=0)
    return client.completions.create(
        model=dep.model, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )


def test_tenants_never_share_prefix_blocks(dep):
    first = _ask(dep, "key-a-123")
    start = _hits(dep)
    other = _ask(dep, "key-b-456")
    assert _hits(dep) == start, "tenant B hit tenant A's cached blocks"
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].text == first.choices[0].text  # same model, same greedy answer
    again = _ask(dep, "key-a-123")
    assert _hits(dep) - start >= 32  # tenant A reuses its own blocks
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


def test_bad_key_is_401(dep):
    with pytest.raises(openai.AuthenticationError):
        _ask(dep, "wrong")
