"""The completion routes' fast path (gateway/fast_routes.py) answers as FastAPI's routing does.

Two gateways over the same decode, one with the fast path (what ships) and one without
(`create_app(..., fast_routes=False)`), get the same requests: statuses, the headers clients
read, and bodies (ids and timestamps aside) must match, for successes, streams and every kind
of refusal the edge and the routes give. Unit tests pin the dispatch itself: which requests it
takes, and which handler answers what an endpoint raises.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from gateway.app import build_state, create_app
from gateway.config import GatewaySettings
from gateway.errors import APIError, install_handlers
from gateway.fast_routes import FastRoutes
from tests.gateway.conftest import MAX_MODEL_LEN, SERVED_NAME, serve
from tests.gateway.edge_util import KEY_ALPHA, KEY_GAMMA, write_keys

MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_BODY_BYTES = 64 * 1024
# What clients read besides the body (content-length: the bodies match, so must their sizes).
HEADERS = ("content-type", "content-length", "retry-after", "www-authenticate", "allow")


@pytest.fixture(scope="module")
def both(tiny_qwen3_path, model_info, fakes, tmp_path_factory):
    """{"fast": url, "slow": url}: same settings, same decode, own (memory) quotas."""
    keys = write_keys(
        tmp_path_factory.mktemp("keys") / "keys",
        [(KEY_ALPHA, "alpha", None), (KEY_GAMMA, "gamma", {"requests_per_min": 2})],
    )
    settings = GatewaySettings(
        model=str(tiny_qwen3_path),
        served_model_name=[SERVED_NAME],
        max_model_len=MAX_MODEL_LEN,
        decode=[fakes[0][1]],
        api_keys_file=keys,
        max_request_body_bytes=MAX_BODY_BYTES,
        max_messages=4,
    )
    fast = create_app(settings, build_state(settings, model=model_info))
    slow = create_app(settings, build_state(settings, model=model_info), fast_routes=False)
    with serve(fast) as fast_url, serve(slow) as slow_url:
        yield {"fast": fast_url, "slow": slow_url}


def _normalized(resp: httpx.Response) -> tuple:
    """What must match between the paths: status, client-visible headers, the body with its
    ids and timestamps (and a 429's wait, which depends on the clock) masked."""
    headers = {h: resp.headers.get(h) for h in HEADERS}
    if headers["retry-after"] is not None:
        headers["retry-after"] = "<s>"
    text = resp.text
    if resp.status_code == 429:
        text = re.sub(r"try again in \d+s", "try again in <s>s", text)
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
        body = _stream_summary([e if e == "[DONE]" else json.loads(e) for e in events])
    elif resp.headers.get("content-type") == "application/json":
        body = _masked(json.loads(text))
    else:
        body = text
    return resp.status_code, headers, body


def _stream_summary(events: list) -> tuple:
    """Per choice: its text, role and ends; the other events; every event's shape. How tokens
    fall into chunks, and how choices interleave, depends on timing, not on the path."""
    choices: dict[int, dict] = {}
    others, shapes = [], set()
    for event in events:
        if event == "[DONE]" or not event.get("choices"):
            others.append(event if event == "[DONE]" else _masked(event))
            continue
        for c in event["choices"]:
            shapes.add((tuple(event), tuple(c), tuple(c.get("delta", ()))))
            s = choices.setdefault(c["index"], {"text": "", "roles": [], "ends": []})
            delta = c.get("delta", {})
            s["text"] += c.get("text") or delta.get("content") or ""
            s["roles"] += [delta["role"]] if delta.get("role") else []
            s["ends"] += [(c["finish_reason"], c["stop_reason"])] if c["finish_reason"] else []
    return choices, others, sorted(shapes)


def _masked(body):
    if isinstance(body, dict):
        return {k: "<x>" if k in ("id", "created") else _masked(v) for k, v in body.items()}
    return body


def _both(both, method: str, path: str, **kwargs) -> tuple:
    answers = [_normalized(httpx.request(method, f"{both[p]}{path}", **kwargs)) for p in both]
    assert answers[0] == answers[1], "the fast path answered otherwise than FastAPI's routing"
    return answers[0]


AUTH = {"Authorization": f"Bearer {KEY_ALPHA}"}
GREEDY = {"model": SERVED_NAME, "max_tokens": 3, "temperature": 0}


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        (CHAT, {**GREEDY, "messages": MESSAGES}, 200),
        (CHAT, {**GREEDY, "messages": MESSAGES, "stream": True}, 200),
        (CHAT, {**GREEDY, "messages": MESSAGES, "n": 2, "logprobs": True}, 200),
        (
            CHAT,
            {
                **GREEDY,
                "messages": MESSAGES,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            200,
        ),
        (COMPLETIONS, {**GREEDY, "prompt": "Hello"}, 200),
        (COMPLETIONS, {**GREEDY, "prompt": ["Hello", "Bye"], "stream": True}, 200),
        (COMPLETIONS, {**GREEDY, "prompt": "Hello", "echo": True, "logprobs": 2}, 200),
        (CHAT, {**GREEDY, "model": "nope", "messages": MESSAGES}, 404),
        (CHAT, {**GREEDY, "messages": "Hi"}, 400),  # pydantic: not a list
        (CHAT, {**GREEDY, "max_tokens": "3", "messages": MESSAGES}, 400),  # strict types
        (CHAT, {**GREEDY, "messages": MESSAGES * 5}, 400),  # over max_messages
        (CHAT, {**GREEDY, "messages": MESSAGES, "functions": [{"name": "f"}]}, 400),
        (CHAT, {**GREEDY, "messages": MESSAGES, "top_p": 1.5}, 400),
        (COMPLETIONS, {**GREEDY, "prompt": [5] * 300}, 400),  # over the context
        (COMPLETIONS, {**GREEDY, "prompt": "x", "max_tokens": 10**6}, 400),
        (COMPLETIONS, {"model": SERVED_NAME}, 400),  # no prompt
    ],
)
def test_same_answers_as_fastapi_routing(both, path, body, status):
    answer = _both(both, "POST", path, json=body, headers=AUTH)
    assert answer[0] == status, answer


@pytest.mark.parametrize(
    ("path", "content", "headers", "status"),
    [
        (CHAT, b"{not json", AUTH, 400),
        (CHAT, b"[1, 2]", AUTH, 400),
        (COMPLETIONS, b"", AUTH, 400),
        (CHAT, json.dumps({"model": SERVED_NAME, "messages": MESSAGES}).encode(), {}, 401),
        (CHAT, b"{}", {"Authorization": "Bearer sk-wrong"}, 401),
        (CHAT, b"{}", {"Authorization": "Basic abc"}, 401),
        (COMPLETIONS, b"x" * (MAX_BODY_BYTES + 1), AUTH, 413),
    ],
)
def test_same_refusals_of_raw_bodies(both, path, content, headers, status):
    answer = _both(both, "POST", path, content=content, headers=headers)
    assert answer[0] == status, answer


def test_same_refusals_by_method_and_headers(both):
    assert _both(both, "GET", CHAT, headers=AUTH)[0] == 405
    assert _both(both, "PUT", COMPLETIONS, headers=AUTH)[0] == 405
    assert _both(both, "POST", f"{CHAT}/", headers=AUTH)[0] == 404  # no trailing-slash variant
    two_keys = [("Authorization", f"Bearer {KEY_ALPHA}"), ("Authorization", "Bearer x")]
    assert _both(both, "POST", CHAT, content=b"{}", headers=two_keys)[0] == 400


def test_same_quota_refusals(both):
    """2 requests a minute for this key, counted by each gateway alike: the third is a 429."""
    body = {**GREEDY, "messages": MESSAGES}
    headers = {"Authorization": f"Bearer {KEY_GAMMA}"}
    statuses = [_both(both, "POST", CHAT, json=body, headers=headers)[0] for _ in range(3)]
    assert statuses == [200, 200, 429]


# --- The dispatch, without a server.


async def _endpoint(request, state, principal):
    return PlainTextResponse(f"fast {principal} {state} {(await request.body()).decode()}")


def _app(endpoint=_endpoint) -> FastAPI:
    """The gateway's handlers, FastRoutes innermost, and a stand-in for the edge that sets the
    principal (gateway/allowlist.py)."""
    app = FastAPI()
    install_handlers(app)

    @app.api_route("/fast", methods=["GET", "POST"])
    async def slow() -> PlainTextResponse:
        return PlainTextResponse("slow")

    app.add_middleware(
        FastRoutes, state="state", endpoints={"/fast": endpoint}, handlers=app.exception_handlers
    )

    def with_principal(inner):
        async def edge(scope, receive, send):
            scope.setdefault("state", {})["principal"] = "p"
            await inner(scope, receive, send)

        return edge

    app.add_middleware(with_principal)
    return app


def test_takes_only_posts_to_its_paths():
    client = TestClient(_app())
    assert client.post("/fast", content=b"hi").text == "fast p state hi"
    assert client.get("/fast").text == "slow"


def _raising(exc: Exception):
    async def endpoint(request, state, principal):
        raise exc

    return endpoint


@pytest.mark.parametrize(
    ("exc", "status", "message"),
    [
        (APIError("Nope.", 404, param="model"), 404, "Nope."),
        (APIError("Slow down.", 429, retry_after_s=3), 429, "Slow down."),
        (
            RequestValidationError([{"loc": ("body", "n"), "msg": "bad n", "type": "x"}]),
            400,
            "n: bad n",
        ),
        (HTTPException(409, "Conflict here."), 409, "Conflict here."),
    ],
)
def test_raised_errors_get_the_app_handlers_answer(exc, status, message):
    fast = TestClient(_app(_raising(exc))).post("/fast")
    assert fast.status_code == status
    assert fast.json()["error"]["message"] == message
    if isinstance(exc, APIError):  # byte for byte what the handler sends
        expected = exc.response()
        assert fast.content == expected.body
        assert fast.headers.get("retry-after") == expected.headers.get("retry-after")


def test_unexpected_errors_reach_the_500_handler():
    client = TestClient(_app(_raising(RuntimeError("bug"))), raise_server_exceptions=False)
    resp = client.post("/fast")
    assert resp.status_code == 500
    assert resp.json()["error"]["message"] == "Internal server error."
