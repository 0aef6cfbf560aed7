"""A stub OpenAI-compatible streaming server with known timings, for `tandem bench serve`.

What a request gets is decided by `script_for(body)`: its first token after `ttft_ms` (default
50), then one every `itl_ms` (default 10), `max_tokens` of them, usage in a last chunk when the
client asked for it; the prompt can change that with words such as `ttft_ms=80`, `itl_ms=5`,
`status=500`, `error_after=3` (an error event after 3 tokens) or `no_usage`. Chat streams open
with an empty role chunk (it is not the first token).

The script is served two ways: `StubSession`, an in-memory aiohttp session look-alike whose
delays are `asyncio.sleep`s (on `VirtualTimeLoop` they take no real time and the figures come
out exact),
and `StubServer`, a real HTTP/1.1 server on loopback in its own thread. Both keep `StubStats`:
bodies, in-flight count at each arrival and the peak.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import selectors
import threading
from dataclasses import dataclass, field

WORDS = ("the", " time", " of", " year", " people", " way", " day", " man", " world", " life")


@dataclass(frozen=True)
class Script:
    status: int
    events: list[tuple[float, bytes]]  # (seconds to wait, bytes to send then)


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def script_for(body: dict) -> Script:
    is_chat = "messages" in body
    prompt = body["messages"][0]["content"] if is_chat else body["prompt"]
    opts = dict(re.findall(r"(\w+)=(\d+)", prompt))
    if "status" in opts:
        error = {"error": {"message": "stub failure", "code": int(opts["status"])}}
        return Script(int(opts["status"]), [(0.0, json.dumps(error).encode())])
    ttft_s, itl_s = int(opts.get("ttft_ms", 50)) / 1000, int(opts.get("itl_ms", 10)) / 1000
    num_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    error_after = int(opts.get("error_after", -1))
    events = []
    if is_chat:
        events.append(
            (0.0, _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        )
    for i in range(num_tokens):
        if i == error_after:
            events.append((0.0, _sse({"error": {"message": "boom", "code": 500}})))
            break
        word = WORDS[i % len(WORDS)]
        choice = {"index": 0, "delta": {"content": word}} if is_chat else {"index": 0, "text": word}
        events.append((ttft_s if i == 0 else itl_s, _sse({"choices": [choice]})))
    wants_usage = (body.get("stream_options") or {}).get("include_usage")
    if wants_usage and "no_usage" not in prompt and error_after < 0:
        usage = {
            "prompt_tokens": 7,
            "completion_tokens": num_tokens,
            "total_tokens": 7 + num_tokens,
        }
        events.append((0.0, _sse({"choices": [], "usage": usage})))
    events.append((0.0, b"data: [DONE]\n\n"))
    return Script(200, events)


@dataclass
class StubStats:
    bodies: list[dict] = field(default_factory=list)
    arrival_s: list[float] = field(default_factory=list)  # on the loop's clock
    in_flight_at_arrival: list[int] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0

    def arrive(self, body: dict, now_s: float) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.bodies.append(body)
        self.arrival_s.append(now_s)
        self.in_flight_at_arrival.append(self.in_flight)


# ---- in-process, for virtual time -----------------------------------------------------------
class _StubResponse:
    """What `send_request` reads of an aiohttp response: status, read(), content.iter_any()."""

    def __init__(self, script: Script, stats: StubStats):
        self.script, self.stats = script, stats
        self.status = script.status
        self.content = self
        self.is_open = True

    async def read(self) -> bytes:
        data = b"".join(data for _, data in self.script.events)
        self.close()
        return data

    async def iter_any(self):
        for delay_s, data in self.script.events:
            if delay_s:
                await asyncio.sleep(delay_s)
            yield data
        self.close()

    def close(self) -> None:
        if self.is_open:
            self.is_open = False
            self.stats.in_flight -= 1


class _StubCall:
    def __init__(self, body: dict, stats: StubStats):
        self.body, self.stats = body, stats

    async def __aenter__(self) -> _StubResponse:
        self.stats.arrive(self.body, asyncio.get_running_loop().time())
        self.response = _StubResponse(script_for(self.body), self.stats)
        return self.response

    async def __aexit__(self, *exc) -> None:
        self.response.close()


class StubSession:
    """An aiohttp.ClientSession look-alike that serves the script from memory."""

    def __init__(self):
        self.stats = StubStats()

    def post(self, url: str, json: dict, headers: dict) -> _StubCall:
        return _StubCall(copy.deepcopy(json), self.stats)

    async def close(self) -> None:
        pass


class _JumpingSelector:
    """A selector for a loop with nothing to wait for on sockets: where the loop would sleep
    until its next timer, it moves the loop's clock there instead."""

    def __init__(self, loop: VirtualTimeLoop):
        self._loop, self._real = loop, selectors.DefaultSelector()

    def __getattr__(self, name):  # register, unregister, get_map, close, ...
        return getattr(self._real, name)

    def select(self, timeout=None):
        events = self._real.select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # no timer and nothing ready: only another thread could help
            events = self._real.select(5.0)
            assert events, "virtual-time loop deadlocked"
            return events
        self._loop.now_s += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """asyncio on a virtual clock: `asyncio.sleep(d)` takes no real time and `time()` moves by
    exactly d. For code whose only I/O is in memory (`StubSession`)."""

    def __init__(self):
        self.now_s = 0.0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self.now_s


def run_virtual(make_coro):
    """Run `make_coro(clock)` on a fresh `VirtualTimeLoop`; `clock` is the loop's time."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(make_coro(loop.time))
    finally:
        loop.close()


# ---- over HTTP, in real time -----------------------------------------------------------------
class StubServer:
    """The script over a real socket (HTTP/1.1, chunked, keep-alive), in a thread of its own."""

    def __init__(self):
        self.stats = StubStats()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StubServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()

    async def _handle(self, reader, writer) -> None:
        try:
            while True:  # keep-alive: one request after another on this connection
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                length = int(re.search(r"(?i)content-length:\s*(\d+)", head).group(1))
                body = json.loads(await reader.readexactly(length))
                self.stats.arrive(body, asyncio.get_running_loop().time())
                try:
                    script = script_for(body)
                    writer.write(
                        f"HTTP/1.1 {script.status} Stub\r\nContent-Type: text/event-stream\r\n"
                        "Transfer-Encoding: chunked\r\n\r\n".encode()
                    )
                    for delay_s, data in script.events:
                        if delay_s:
                            await asyncio.sleep(delay_s)
                        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                        await writer.drain()
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
                finally:
                    self.stats.in_flight -= 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()
