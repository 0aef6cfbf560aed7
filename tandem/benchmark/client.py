"""One streamed request to an OpenAI-compatible server, timed as vLLM's benchmark times it.

Timestamps come from `clock` (seconds, monotonic; `time.perf_counter` unless a test injects a
fake one). TTFT is the first chunk that carries content; each later content chunk adds one
inter-token latency (ITL); E2EL runs to the last data message. Output tokens are the server's
`usage.completion_tokens` (asked for with `stream_options.include_usage`), 0 when it sent none.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tandem.benchmark.datasets import SampleRequest

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
Clock = Callable[[], float]


@dataclass
class RequestOutput:
    prompt_len: int = 0
    is_success: bool = False
    generated_text: str = ""
    output_tokens: int = 0  # usage.completion_tokens; 0: not reported
    start_s: float = 0.0  # on the run's clock
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0  # E2EL
    error: str = ""


def build_payload(
    backend: str,
    model: str,
    request: SampleRequest,
    ignore_eos: bool = False,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The request body: greedy unless `extra_body` says otherwise, streamed, usage asked for."""
    payload: dict[str, Any] = {"model": model, "temperature": 0.0}
    if backend == "openai":
        payload |= {"prompt": request.prompt, "max_tokens": request.expected_output_len}
    elif backend == "openai-chat":
        payload |= {
            "messages": [{"role": "user", "content": request.prompt}],
            "max_completion_tokens": request.expected_output_len,
        }
    else:
        raise ValueError(f"unknown backend {backend!r}; one of {', '.join(BACKENDS)}")
    payload |= {"stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload | (extra_body or {})


def _content(backend: str, choice: dict[str, Any]) -> str:
    if backend == "openai-chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def _sse_data(
    pieces: AsyncIterator[bytes], clock: Clock
) -> AsyncIterator[tuple[float, bytes]]:
    """(time of the read that completed it, payload) of each SSE `data:` line."""
    pending = b""
    async for piece in pieces:
        now = clock()
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):  # not blank separators, ":" pings, event names
                yield now, line[5:].strip()


def new_session(max_concurrency: int | None) -> aiohttp.ClientSession:
    """aiohttp, as vLLM's client: its C HTTP parser costs about half of httpx's CPU per chunk,
    and at thousands of chunks a second the client's own time would show up as latency.
    Connections are kept alive; no pool limit below the benchmark's own (a queue in the client
    would pass for server latency)."""
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)  # vLLM's: a slow request is a figure
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=True)


async def send_request(
    session: aiohttp.ClientSession,
    api_url: str,
    backend: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    prompt_len: int,
    clock: Clock,
) -> RequestOutput:
    """POST `payload` and read its SSE stream; never raises (a failure is in `error`)."""
    out = RequestOutput(prompt_len=prompt_len)
    start = out.start_s = clock()
    last = start
    text: list[str] = []
    try:
        async with session.post(api_url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode("utf-8", "replace")
                out.error = f"HTTP {resp.status}: {body[:300]}"
                return out
            async for now, data in _sse_data(resp.content.iter_any(), clock):
                if data == b"[DONE]":
                    continue  # read on to the end: the connection goes back to the pool
                chunk = json.loads(data)
                if "error" in chunk and not chunk.get("choices"):
                    err = chunk["error"]
                    out.error = (
                        f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    )
                    return out
                if chunk.get("choices"):
                    content = _content(backend, chunk["choices"][0])
                    if content:
                        if not text:
                            out.ttft_s = now - start
                        else:
                            out.itl_s.append(now - last)
                        text.append(content)
                        last = now
                if chunk.get("usage"):
                    out.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                out.latency_s = now - start
    except Exception as e:  # noqa: BLE001 - any failure is the request's result, not the run's
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.generated_text = "".join(text)
    if not text:
        out.error = "no content received: the stream carried no token"
        return out
    out.is_success = True
    return out
