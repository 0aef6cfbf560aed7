"""Batched bookkeeping (gateway/bookkeeping.py) and the access log written through it."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from types import SimpleNamespace

from gateway import access_log
from gateway.access_log import AccessLogMiddleware
from gateway.bookkeeping import Bookkeeping
from tests.gateway.edge_util import KEY_ALPHA, chat, edge_gateway


def test_deferred_work_waits_for_its_batch_then_runs_in_order():
    done: list[int] = []

    async def main() -> None:
        book = Bookkeeping(interval_s=0.05)
        book.defer(done.append, 1)
        book.defer(done.append, 2)
        assert done == [] and book.num_pending == 2  # not run inline
        while book.num_pending:  # the batch's timer, on this loop
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert done == [1, 2]


def test_a_full_batch_runs_at_once_and_flush_runs_the_rest():
    done: list[int] = []

    async def main() -> None:
        book = Bookkeeping(interval_s=60.0, max_pending=3)
        for i in range(4):
            book.defer(done.append, i)
        assert done == [0, 1, 2] and book.num_pending == 1
        book.flush()
        assert done == [0, 1, 2, 3] and book.num_pending == 0

    asyncio.run(main())


def test_without_a_loop_work_runs_at_once():
    done: list[str] = []
    Bookkeeping().defer(done.append, "now")
    assert done == ["now"]


def test_a_failure_is_logged_and_the_batch_goes_on(caplog):
    done: list[int] = []

    def broken() -> None:
        raise ValueError("boom")

    book = Bookkeeping(interval_s=60.0, max_pending=10)

    async def main() -> None:
        book.defer(done.append, 1)
        book.defer(broken)
        book.defer(done.append, 2)
        book.flush()

    with caplog.at_level(logging.ERROR, logger="gateway.bookkeeping"):
        asyncio.run(main())
    assert done == [1, 2]
    (record,) = [r for r in caplog.records if r.name == "gateway.bookkeeping"]
    assert "broken" in record.getMessage() and record.exc_info[0] is ValueError


def _request(app, path: str = "/v1/models"):
    scope = {"type": "http", "method": "GET", "path": path, "state": {}}

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        pass

    return app(scope, receive, send)


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def test_access_lines_keep_the_time_their_request_ended(caplog, monkeypatch):
    clock = SimpleNamespace(time=lambda: 1_700_000_000.25, perf_counter=time.perf_counter)
    monkeypatch.setattr(access_log, "time", clock)
    book = Bookkeeping(interval_s=60.0)
    app = AccessLogMiddleware(_ok, book)

    async def main() -> None:
        await _request(app)
        assert book.num_pending == 1  # written later, with its batch
        monkeypatch.setattr(access_log, "time", time)
        book.flush()

    with caplog.at_level(logging.INFO, logger="gateway.access"):
        asyncio.run(main())
    (record,) = [r for r in caplog.records if r.name == "gateway.access"]
    assert record.getMessage().startswith("GET /v1/models 200 ")
    assert record.getMessage().endswith("tenant=-")
    assert record.created == 1_700_000_000.25 and record.msecs == 250.0


def test_no_line_is_deferred_while_the_access_log_is_off(caplog):
    book = Bookkeeping(interval_s=60.0)
    app = AccessLogMiddleware(_ok, book)
    with caplog.at_level(logging.WARNING, logger="gateway.access"):
        asyncio.run(_request(app))
    assert book.num_pending == 0


def test_paths_outside_the_allowlist_are_not_logged(caplog):
    book = Bookkeeping(interval_s=60.0)
    app = AccessLogMiddleware(_ok, book)

    async def main() -> None:
        await _request(app, "/v1/sk-secret-in-a-path")
        book.flush()

    with caplog.at_level(logging.INFO, logger="gateway.access"):
        asyncio.run(main())
    (record,) = [r for r in caplog.records if r.name == "gateway.access"]
    assert "<not allowed>" in record.getMessage() and "secret" not in record.getMessage()


def test_a_gateway_that_stops_writes_what_it_held(tiny_qwen3_path, model_info, fakes, caplog):
    """The app's shutdown flushes the batch: no line or metric is lost to a drained stop."""
    keys = f"{KEY_ALPHA}:alpha"
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        with edge_gateway(tiny_qwen3_path, model_info, decode=[fakes[0][1]], api_keys=keys) as (
            url,
            state,
        ):
            state.edge.bookkeeping.interval_s = 3600.0  # only the shutdown can write it
            chat(url, KEY_ALPHA)
            assert not [r for r in caplog.records if r.name == "gateway.access"]
        lines = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
    assert len(lines) == 1 and lines[0].startswith("POST /v1/chat/completions 200 ")
    assert lines[0].endswith("tenant=alpha")


def test_a_gateway_that_stops_writes_its_route_log_before_closing_it(
    tiny_qwen3_path, model_info, fakes, tmp_path
):
    """The router's observation of a finished request is deferred too; the shutdown runs it
    before the router closes its `--route-log`, so the last request keeps its line."""
    log = tmp_path / "routes.jsonl"
    with edge_gateway(tiny_qwen3_path, model_info, decode=[fakes[0][1]], route_log=str(log)) as (
        url,
        state,
    ):
        state.edge.bookkeeping.interval_s = 3600.0  # only the shutdown can write it
        chat(url, KEY_ALPHA)
        assert log.read_text() == ""
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["measured_ttft_s"] > 0
