"""Load shedding (gateway/shedding.py): the adaptive limit's steps, and a real gateway at a tiny
capacity bound: a burst past it is refused at once with a retryable 503 and Retry-After, while
/health, /v1/models and the requests already admitted keep being served, and nothing hangs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import time

import httpx
import pydantic
import pytest

from gateway import shedding
from gateway.__main__ import parse_args, settings_from_args
from gateway.config import GatewaySettings
from gateway.metrics import GatewayMetrics
from gateway.shedding import MAX_LIMIT, MIN_LIMIT, AdmissionLimit, Shedder
from tests.gateway.conftest import SERVED_NAME
from tests.gateway.edge_util import edge_gateway, wait_for

BURST = 40
_BOUNDS = ("--shed-busy-fraction", "--max-inflight-requests")
PROMPT = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 100, "ignore_eos": True}
CHAT = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _end(limit: AdmissionLimit, is_overloaded: bool, num_inflight: int, **kwargs) -> int:
    kwargs.setdefault("peak_inflight", num_inflight)
    kwargs.setdefault("has_refused", False)
    limit.end_window(is_overloaded, num_inflight, **kwargs)
    return limit.limit


def test_limit_drops_below_what_is_in_flight_when_overloaded_and_refusing():
    limit = AdmissionLimit(limit=100)
    assert _end(limit, True, 50, has_refused=True) == 40  # 0.8 x in flight
    assert _end(limit, True, 45, has_refused=True) == 36
    # Still above the limit (the last cut has not taken effect): not cut again.
    assert _end(limit, True, 200, has_refused=True) == 36
    for _ in range(50):
        _end(limit, True, 0, has_refused=True)
    assert limit.limit == MIN_LIMIT


def test_overloaded_without_refusals_keeps_room_for_what_is_in_flight_and_no_more():
    """Busy with what it admitted: the limit closes in to HEADROOM x the peak in flight +
    MIN_LIMIT, never below what is in flight, and never grows."""
    limit = AdmissionLimit(limit=MAX_LIMIT)
    assert _end(limit, True, 480, peak_inflight=512) == int(1.25 * 512) + MIN_LIMIT == 644
    assert _end(limit, True, 512, peak_inflight=512) == 644  # a steady closed loop: it stays
    assert _end(limit, True, 600, peak_inflight=700) == 644  # never grows while overloaded
    assert _end(limit, True, 0, peak_inflight=0) == MIN_LIMIT  # busy with nothing in flight
    limit = AdmissionLimit(limit=40)
    assert _end(limit, True, 50, peak_inflight=50) == 40  # a limit below it stays there


def test_limit_grows_while_not_overloaded():
    limit = AdmissionLimit(limit=10)
    assert _end(limit, False, 3) == 12
    # Streams admitted before a drop, served without overload now: the limit comes back above
    # them at once, not 10% a window from the floor.
    assert _end(AdmissionLimit(limit=MIN_LIMIT), False, 500) == 551
    assert _end(AdmissionLimit(limit=MAX_LIMIT), False, MAX_LIMIT) == MAX_LIMIT


def _shedder(**overrides) -> Shedder:
    settings = GatewaySettings(model="m", **overrides)
    return Shedder(settings, GatewayMetrics("m"))


def test_admission_counts_in_flight_and_names_the_bound():
    s = _shedder(max_inflight_requests=2)
    assert s.admit() is None and s.admit() is None
    assert s.admit() == "max_inflight"
    s.done()
    assert s.admit() is None
    s.adaptive.limit = 3
    assert s.admit() == "max_inflight"  # the lower bound names itself
    assert s.num_refused[-1] == 0  # the operator's cap says nothing about overload
    s.max_inflight = MAX_LIMIT
    assert s.admit() is None
    assert s.admit() == "adaptive"
    assert s.num_refused[-1] == 1 and s.peak_inflight[-1] == 3


def test_shedding_off_has_no_adaptive_limit():
    s = _shedder(shed_busy_fraction=0)
    assert not s.is_adaptive and s.adaptive.limit == MAX_LIMIT


def _run_loop_with(shedder: Shedder, hold_s: float, seconds: float) -> list[int]:
    """Keep the loop busy for `seconds` in slices of `hold_s` CPU between yields, with 50
    requests in flight, the shedder watching; the adaptive limit after each slice."""

    async def main() -> list[int]:
        shedder.start()
        shedder.num_inflight = 50
        limits, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.thread_time()
            while time.thread_time() - t < hold_s:
                pass
            limits.append(shedder.adaptive.limit)
            await asyncio.sleep(0)
        shedder.close()
        return limits

    return asyncio.run(main())


def test_a_busy_loop_is_overloaded_and_its_lag_is_exported(monkeypatch):
    """A loop kept busy in 30 ms slices: the limit falls below what is in flight, and the lag
    gauge sees its timer fire late (a loop busy in short slices counts as overloaded too: the
    queue of an overloaded gateway forms in its sockets, where the loop's timers do not see
    it; requiring lag let it collapse at twice its saturation rate)."""
    monkeypatch.setattr(shedding, "MIN_CPU_FRACTION", 0.0)
    s = _shedder(shed_busy_fraction=1e-9)
    limits = _run_loop_with(s, hold_s=0.03, seconds=0.8)
    assert limits[-1] < 50
    assert max(s.lags_s) > 0.005  # its timer fired late
    limits = _run_loop_with(_shedder(shed_busy_fraction=1e-9), hold_s=0.0005, seconds=0.8)
    assert limits[-1] < 50


def test_flags_and_environment(monkeypatch):
    args = ["--model", "m", "--shed-busy-fraction", "0.5", "--max-inflight-requests", "64"]
    s = settings_from_args(parse_args(args))
    assert (s.shed_busy_fraction, s.max_inflight_requests) == (0.5, 64)
    monkeypatch.setenv("TANDEM_GATEWAY_SHED_BUSY_FRACTION", "0.7")
    assert settings_from_args(parse_args(["--model", "m"])).shed_busy_fraction == 0.7
    monkeypatch.delenv("TANDEM_GATEWAY_SHED_BUSY_FRACTION")
    defaults = GatewaySettings(model="m")
    assert (defaults.shed_busy_fraction, defaults.max_inflight_requests) == (0.9, 0)
    for flag, value in [("--shed-busy-fraction", "1.5"), *[(f, "-1") for f in _BOUNDS]]:
        with pytest.raises(pydantic.ValidationError, match="than or equal to"):
            settings_from_args(parse_args(["--model", "m", flag, value]))


def test_busy_time_counts_waiting_for_a_cpu():
    """schedstat's on-CPU and on-CPU + waiting times of this thread."""
    if not shedding.SCHEDSTAT.exists():
        pytest.skip("no /proc/thread-self/schedstat")
    cpu_s, busy_s = shedding.loop_thread_times()
    assert busy_s >= cpu_s > 0
    assert cpu_s == pytest.approx(time.thread_time(), rel=0.05)


def _scrape(state) -> str:
    return httpx.get("http://{}:{}/metrics".format(*state.edge.metrics_address)).text


def _metric(text: str, name: str) -> str:
    return next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " "))


def _hold_streams(url: str, n: int, stack: contextlib.ExitStack) -> list:
    """n streamed completions, each past its first chunk: admitted and in flight until the
    stack closes. Keep the returned line iterators: dropping one closes its connection."""
    lines = []
    for _ in range(n):
        client = stack.enter_context(httpx.Client(base_url=url, timeout=30))
        resp = stack.enter_context(
            client.stream("POST", "/v1/completions", json={**PROMPT, "stream": True})
        )
        assert resp.status_code == 200
        lines.append(resp.iter_lines())
        assert next(lines[-1]).startswith("data: ")
    return lines


def _burst(url: str) -> list[tuple[httpx.Response, float]]:
    """BURST chat requests at once, each on its own connection: (response, seconds)."""

    def one(_: int) -> tuple[httpx.Response, float]:
        start = time.monotonic()
        resp = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        return resp, time.monotonic() - start

    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(one, range(BURST)))


def _assert_refused(results: list[tuple[httpx.Response, float]]) -> None:
    for resp, elapsed_s in results:
        assert resp.status_code == 503, resp.text
        assert resp.headers["retry-after"] == "1"
        error = resp.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
        assert "overloaded" in error["message"]
        assert elapsed_s < 5  # refused, not queued


@pytest.fixture
def slow_fake(fake):
    fake.knobs.token_delay_s = 0.5  # a held stream stays in flight until it is closed
    return fake


def test_a_burst_past_the_cap_gets_retryable_503s_and_the_gateway_stays_responsive(
    tiny_qwen3_path, model_info, fakes, slow_fake
):
    settings = dict(decode=[fakes[0][1]], max_inflight_requests=2, metrics_port=0)
    with edge_gateway(tiny_qwen3_path, model_info, **settings) as (url, state):
        with contextlib.ExitStack() as stack:
            held = _hold_streams(url, 2, stack)
            _assert_refused(_burst(url))
            # Probes and GET routes are never shed; the admitted streams keep streaming.
            start = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
            assert time.monotonic() - start < 2
            metrics = _scrape(state)
            assert f'tandem:requests_shed_total{{reason="max_inflight"}} {BURST}.0' in metrics
            assert "tandem:requests_in_flight 2.0" in metrics
            for lines in held:  # the admitted streams were not disturbed
                assert next(line for line in lines if line).startswith("data: ")
        # The held streams are gone (client disconnects): their places come back.
        wait_for(lambda: "tandem:requests_in_flight 0.0" in _scrape(state))
        slow_fake.knobs.token_delay_s = 0.0
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_a_refusal_does_not_wait_for_the_body(tiny_qwen3_path, model_info, fakes, slow_fake):
    """The 503 is sent before the body is read: a client that sends only its headers still
    gets it at once."""
    settings = dict(decode=[fakes[0][1]], max_inflight_requests=1)
    with edge_gateway(tiny_qwen3_path, model_info, **settings) as (url, _):
        with contextlib.ExitStack() as stack:
            held = _hold_streams(url, 1, stack)
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                head = (
                    "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                )
                sock.sendall(head.encode())
                answer = sock.recv(4096).decode()
            assert answer.startswith("HTTP/1.1 503") and "retry-after: 1" in answer.lower()
            assert next(line for line in held[0] if line).startswith("data: ")


def test_the_adaptive_limit_sheds_when_the_process_counts_as_overloaded(
    tiny_qwen3_path, model_info, fakes, slow_fake, monkeypatch
):
    """Any busy time counts as overload here (`shed_busy_fraction` tiny, no CPU floor): the
    limit falls to its floor, MIN_LIMIT, and the request past it is refused as `adaptive`."""
    monkeypatch.setattr(shedding, "MIN_CPU_FRACTION", 0.0)
    assert MIN_LIMIT == 4
    settings = dict(decode=[fakes[0][1]], shed_busy_fraction=1e-9, metrics_port=0)
    with edge_gateway(tiny_qwen3_path, model_info, **settings) as (url, state):
        wait_for(lambda: f"tandem:admission_limit {MIN_LIMIT}.0" in _scrape(state))
        with contextlib.ExitStack() as stack:
            held = _hold_streams(url, MIN_LIMIT, stack)
            _assert_refused(_burst(url))
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            assert f'tandem:requests_shed_total{{reason="adaptive"}} {BURST}.0' in _scrape(state)
            assert all(next(line for line in lines if line) for lines in held)


class LoadedLoop:
    """`loop_thread_times` for a loop whose thread is busy exactly while requests are in flight
    (the shedder's own count): a gateway whose CPU goes to what it has admitted, as one relaying
    many streams behind a GPU. Busy or idle then follows the load, not this machine's."""

    def __init__(self, monkeypatch, load_at: int = 1):
        self.shedder: Shedder | None = None
        self.load_at = load_at  # idle until this many were in flight at once
        self.is_loaded = False  # ... or while this is False
        self.busy_s, self.last = 0.0, time.monotonic()
        start = Shedder.start

        def capture(shedder: Shedder) -> None:
            self.shedder = shedder
            start(shedder)

        monkeypatch.setattr(Shedder, "start", capture)
        monkeypatch.setattr(shedding, "loop_thread_times", self.times)

    def times(self, fd=None) -> tuple[float, float]:
        now = time.monotonic()
        if self.shedder is not None and max(self.shedder.peak_inflight) >= self.load_at:
            self.is_loaded = True
        if self.is_loaded and self.shedder is not None and self.shedder.num_inflight > 0:
            self.busy_s += now - self.last
        self.last = now
        return self.busy_s, self.busy_s


def _closed_loop(url: str, clients: int, requests_each: int) -> list[int]:
    """`clients` threads, each sending its streamed completions one after another (a new one as
    soon as the last ended, as a benchmark at fixed concurrency does): every status code."""

    def client(_: int) -> list[int]:
        codes = []
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(requests_each):
                body = {**PROMPT, "max_tokens": 4, "stream": True}
                with http.stream("POST", "/v1/completions", json=body) as resp:
                    codes.append(resp.status_code)
                    resp.read()
        return codes

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return [code for codes in pool.map(client, range(clients)) for code in codes]


def test_a_loop_busy_with_what_it_admitted_refuses_no_client_of_a_closed_loop(
    tiny_qwen3_path, model_info, fakes, fake, monkeypatch
):
    """Streams keep the loop busy (every window past the busy fraction), but each new request
    replaces one that ended: the gateway is offered no more than it serves, so it refuses
    nothing (it used to drop its limit below what was in flight and refuse the replacements:
    503s at c=256 behind one H200). The same busy loop offered a burst still sheds it.
    The loop turns busy once all clients are in (a benchmark's start is one burst; a ramp
    slower than a window over a loop already busy is a surge, shed as one)."""
    loop = LoadedLoop(monkeypatch, load_at=6)
    monkeypatch.setattr(shedding, "MIN_CPU_FRACTION", 0.0)
    fake.knobs.token_delay_s = 0.05  # each stream ~0.2 s: several windows of a busy loop
    settings = dict(decode=[fakes[0][1]], shed_busy_fraction=0.5, metrics_port=0)
    with edge_gateway(tiny_qwen3_path, model_info, **settings) as (url, state):
        codes = _closed_loop(url, clients=6, requests_each=5)
        assert codes == [200] * 30
        assert loop.busy_s > 5 * shedding.WINDOW_S  # it was busy for many windows meanwhile
        assert 'tandem:requests_shed_total{reason="adaptive"} 0.0' in _scrape(state)
        # Offered more: six streams held (admitted while the loop was idle), then a burst of
        # BURST while they keep it busy. It keeps room for HEADROOM x what it holds; the rest of
        # the burst is refused at once, and the limit drops.
        fake.knobs.token_delay_s = 0.5
        loop.is_loaded, loop.load_at = False, MAX_LIMIT
        with contextlib.ExitStack() as stack:
            held = _hold_streams(url, 6, stack)
            loop.is_loaded = True
            room = int(shedding.HEADROOM * 6) + MIN_LIMIT
            wait_for(lambda: f"tandem:admission_limit {room}.0" in _scrape(state))
            refused = [r for r in _burst(url) if r[0].status_code == 503]
            assert len(refused) >= BURST - (room - 6)
            _assert_refused(refused)
            assert all(next(line for line in lines if line) for lines in held)
            assert float(_metric(_scrape(state), "tandem:admission_limit")) < room
